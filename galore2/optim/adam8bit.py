"""Adam with 8-bit blockwise-quantized moments (``ScaleByAdam8bit``).

Acts on: whatever direction it is given — the full gradient in a plain group,
the projected r×n (or m×r) gradient inside GaLore — with the same arithmetic as
:class:`~galore2.optim.adam.ScaleByAdam`. Each step dequantizes both moments to
fp32, runs ``ScaleByAdam``'s update on them and quantizes them back; the
returned direction is computed from the fp32 moments before requantization (as
bitsandbytes' 8-bit Adam does).

Storage: bitsandbytes' blockwise *dynamic* quantization (8-bit codes of
``create_dynamic_map``, signed for ``exp_avg`` and unsigned for ``exp_avg_sq``,
one fp32 absmax per block of at most 256 elements). State per element of the
direction: 1 byte per moment (2 in all) + 4 bytes per block per moment, plus one
int64 step counter and the block axis (int64) on the CPU. With blocks of 256
elements that is ~1.016 bytes per moment element instead of 4.

Block layout (sharding-independent, so DCP checkpoints reshard): the direction
is viewed as 2-D (dim 0 × rest) and blocks run along the axis that is never
sharded under FSDP —

* layouts ``"param"``, ``"rows"`` and ``"replicate"`` (the parameter itself,
  GaLore's right-side m×r, full-side r×r): each row is split into
  ``ceil(cols / 256)`` blocks; absmax has shape ``(rows, ceil(cols / 256))`` and
  is sharded by rows like the codes;
* layout ``"cols"`` (GaLore's left-side r×n, sharded by columns): each column is
  split along dim 0; absmax has shape ``(ceil(rows / 256), cols)``, sharded by
  columns like the codes.

A row (column) shorter than 256 is one short block, so GaLore's moments are
blocked along the rank axis: rank 256 costs ~1.016 bytes per moment element,
rank 128 ~1.03, rank 8 1.5. Codes are stored at the direction's exact shape
(blocks are padded only transiently, to call bitsandbytes).

Directions with fewer than 4096 elements (bitsandbytes' ``min_8bit_size``,
decided from the *global* shape), 1-D directions and directions whose blocked
axis has a single element keep ``state_dtype`` moments exactly like ``ScaleByAdam``
(same state keys, same results): under FSDP a 1-D tensor has no unsharded axis to
block along, and one-element blocks would cost more than fp32. Quantized moments are
always updated in fp32 (``state_dtype`` does not apply to them).

On CUDA with triton installed (see :mod:`galore2.kernels.dispatch`, ``GALORE2_KERNELS``)
a step is one fused Triton kernel (:mod:`galore2.kernels.adam8bit`) with the same
arithmetic and block layout; its quantizer picks the exact nearest code (bitsandbytes'
CPU quantizer is off by a code or more on a few percent of elements).

bitsandbytes is imported lazily (constructing this transform without it raises
``ImportError``); it only ever sees plain local tensors. Its dynamic code maps are
constants cached per device, not state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.state import counter
from ..core.transform import Context, Group, State
from ..fsdp.detect import is_dtensor
from ..kernels.dispatch import run_kernel
from .adam import ScaleByAdam

BLOCK = 256  # elements per quantization block (bitsandbytes' 8-bit optimizers use 256)
MIN_8BIT_SIZE = 4096  # smaller directions keep fp32 moments (bitsandbytes' min_8bit_size)

_CODES: dict[tuple[str, bool], Tensor] = {}
_BOUNDS: dict[tuple[str, bool], Tensor] = {}


def bnb_functional() -> Any:
    """``bitsandbytes.functional``, imported on first use."""
    try:
        import bitsandbytes.functional as bnb_f
    except ImportError as err:
        raise ImportError(
            "8-bit Adam moments (GaLoreAdamW8bit, ScaleByAdam8bit) need bitsandbytes: "
            "pip install bitsandbytes"
        ) from err
    return bnb_f


def dynamic_code(signed: bool, device: torch.device) -> Tensor:
    """bitsandbytes' 8-bit dynamic code map (256 sorted fp32 values), cached per device."""
    key = (str(device), signed)
    code = _CODES.get(key)
    if code is None:
        code = bnb_functional().create_dynamic_map(signed=signed).to(device)
        _CODES[key] = code
    return code


def code_bounds(signed: bool, device: torch.device) -> Tensor:
    """The 256 decision bounds of :func:`dynamic_code` (midpoints, then +inf) that the fused
    kernel's nearest-code search reads, cached per device."""
    key = (str(device), signed)
    bounds = _BOUNDS.get(key)
    if bounds is None:
        code = dynamic_code(signed, device)
        mid = (code[:-1] + code[1:]) / 2
        bounds = torch.cat((mid, mid.new_full((1,), math.inf))).float().contiguous()
        _BOUNDS[key] = bounds
    return bounds


def block_dim(shape: torch.Size | tuple[int, ...], layout: str) -> int | None:
    """The axis of the 2-D view (dim 0 × rest) that blocks run along; None keeps fp32."""
    numel = math.prod(shape)
    if len(shape) < 2 or numel < MIN_8BIT_SIZE:
        return None
    dim = 0 if layout == "cols" else 1
    length = shape[0] if dim == 0 else numel // shape[0]
    return dim if length > 1 else None


def absmax_shape(shape: torch.Size | tuple[int, ...], dim: int) -> tuple[int, int]:
    rows = int(shape[0])
    cols = math.prod(shape) // rows
    if dim == 1:
        return rows, -(-cols // BLOCK)
    return -(-rows // BLOCK), cols


def _bnb_blocksize(length: int) -> int:
    """bitsandbytes' block size for rows of ``length``: 256, or, for a row that is a single
    short block, the smallest size ≥ it that bitsandbytes supports on every device (64,
    128) — the same blocks, with less transient padding."""
    if length >= BLOCK:
        return BLOCK
    return max(64, 1 << (length - 1).bit_length())


def _local(t: Tensor) -> Tensor:
    return t.to_local() if is_dtensor(t) else t


def _blocked(x: Tensor, dim: int) -> Tensor:
    """A 2-D (dim 0 × rest) view of ``x`` with the blocked axis last (transposed for dim 0)."""
    x = x.reshape(x.shape[0], -1)
    return x.mT if dim == 0 else x


def dequantize(codes: Tensor, absmax: Tensor, dim: int, signed: bool) -> Tensor:
    """fp32 values of local ``codes`` (any shape) with their ``absmax`` (see :func:`absmax_shape`)."""
    codes, absmax = _local(codes), _local(absmax)
    if codes.numel() == 0:
        return torch.zeros(codes.shape, dtype=torch.float32, device=codes.device)
    q = _blocked(codes, dim)
    scale = absmax.mT if dim == 0 else absmax
    length, size = q.shape[1], _bnb_blocksize(q.shape[1])
    padded = scale.shape[1] * size
    if padded != length:
        q = F.pad(q, (0, padded - length))
    out = bnb_functional().dequantize_blockwise(
        q.contiguous(),
        absmax=scale.contiguous().view(-1),
        code=dynamic_code(signed, codes.device),
        blocksize=size,
    )
    out = out[:, :length]
    return (out.mT if dim == 0 else out).reshape(codes.shape)


def quantize_(x: Tensor, codes: Tensor, absmax: Tensor, dim: int, signed: bool) -> None:
    """Store fp32 ``x`` (the shape of local ``codes``) into ``codes`` and ``absmax``."""
    codes, absmax = _local(codes), _local(absmax)
    if codes.numel() == 0:
        return
    v = _blocked(x.float(), dim)
    length, size = v.shape[1], _bnb_blocksize(v.shape[1])
    blocks = -(-length // size)
    if blocks * size != length:
        v = F.pad(v, (0, blocks * size - length))
    q, qstate = bnb_functional().quantize_blockwise(
        v.contiguous(), code=dynamic_code(signed, codes.device), blocksize=size
    )
    q, scale = q[:, :length], qstate.absmax.view(-1, blocks)
    if dim == 0:
        q, scale = q.mT, scale.mT
    codes.copy_(q.reshape(codes.shape))
    absmax.copy_(scale)


class ScaleByAdam8bit(ScaleByAdam):
    """:class:`ScaleByAdam` whose moments are stored 8-bit blockwise; see the module docstring."""

    name = "adam8"
    kinds: ClassVar[dict[str, str]] = {
        **ScaleByAdam.kinds,
        "adam8.exp_avg": "moments",
        "adam8.exp_avg.absmax": "moments",
        "adam8.exp_avg_sq": "moments",
        "adam8.exp_avg_sq.absmax": "moments",
        "adam8.block_dim": "other",
    }
    # (key, signed code map) of the two quantized moments
    QUANTIZED: ClassVar[tuple[tuple[str, bool], ...]] = (
        ("adam8.exp_avg", True),
        ("adam8.exp_avg_sq", False),
    )

    def __init__(self) -> None:
        bnb_functional()  # fail at construction, not at the first step

    @staticmethod
    def quantized(state: State) -> bool:
        return "adam8.exp_avg" in state

    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        dim = block_dim(tuple(shape), ctx.layout)
        if dim is None:
            super().init(shape, ref, group, state, ctx)
            return
        scales = absmax_shape(tuple(shape), dim)
        for key, _ in self.QUANTIZED:
            state[key] = ctx.zeros(shape, torch.uint8)
            state[key + ".absmax"] = ctx.zeros(scales, torch.float32)
        state["adam8.block_dim"] = counter(dim)
        state["adam.step"] = counter()

    # ---- fp32 views of the quantized moments -------------------------------------
    def _load(self, state: State, key: str, signed: bool) -> Tensor:
        dim = int(state["adam8.block_dim"])
        return dequantize(state[key], state[key + ".absmax"], dim, signed)

    def _store(self, state: State, key: str, signed: bool, x: Tensor) -> None:
        dim = int(state["adam8.block_dim"])
        quantize_(x, state[key], state[key + ".absmax"], dim, signed)

    def _fp32_state(self, state: State) -> State:
        """ScaleByAdam's state keys over dequantized copies (the step counter is shared)."""
        (m_key, m_signed), (v_key, v_signed) = self.QUANTIZED
        return {
            "adam.exp_avg": self._load(state, m_key, m_signed),
            "adam.exp_avg_sq": self._load(state, v_key, v_signed),
            "adam.step": state["adam.step"],
        }

    def _store_fp32_state(self, state: State, fp32: State) -> None:
        (m_key, m_signed), (v_key, v_signed) = self.QUANTIZED
        self._store(state, m_key, m_signed, fp32["adam.exp_avg"])
        self._store(state, v_key, v_signed, fp32["adam.exp_avg_sq"])

    # ---- transform protocol ------------------------------------------------------
    def update(self, u: Tensor, state: State, group: Group, ctx: Context) -> Tensor:
        if not self.quantized(state):
            return super().update(u, state, group, ctx)
        (m_key, _), (v_key, _) = self.QUANTIZED
        m_codes, v_codes = _local(state[m_key]), _local(state[v_key])
        out = run_kernel(
            "adam8bit",
            u,
            m_codes,
            v_codes,
            supported=lambda k: k.supported(u),
            kernel=lambda k: self._fused_step(k, u, state, group, m_codes, v_codes),
        )
        if out is not None:  # the kernel updated codes and absmax in place
            state["adam.step"] += 1
            return out
        fp32 = self._fp32_state(state)
        out = super().update(u, fp32, group, ctx)  # the direction uses the fp32 moments
        self._store_fp32_state(state, fp32)
        return out

    def _fused_step(
        self, fused: Any, u: Tensor, state: State, group: Group, m_codes: Tensor, v_codes: Tensor
    ) -> Callable[[], Tensor]:
        """:meth:`update` as one Triton kernel (galore2.kernels.adam8bit), ready to launch:
        the same arithmetic, codes and absmax updated in place, the fp32 direction returned
        (the caller counts the step once it ran; see ``dispatch.run_kernel``)."""
        (m_key, m_signed), (v_key, v_signed) = self.QUANTIZED
        beta1, beta2 = group["betas"]
        device = m_codes.device
        return partial(
            fused.adam8bit_step,
            u,
            m_codes,
            _local(state[m_key + ".absmax"]),
            v_codes,
            _local(state[v_key + ".absmax"]),
            dim=int(state["adam8.block_dim"]),
            code_m=dynamic_code(m_signed, device),
            code_v=dynamic_code(v_signed, device),
            bounds_m=code_bounds(m_signed, device),
            bounds_v=code_bounds(v_signed, device),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            step=int(state["adam.step"]) + 1,
        )

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor]:
        out: list[Tensor | None] = [None] * len(us)
        plain = [i for i, s in enumerate(states) if not self.quantized(s)]
        if plain:  # fp32 moments: ScaleByAdam's batched kernels
            results = super().update_many(
                [us[i] for i in plain], [states[i] for i in plain], group, [ctxs[i] for i in plain]
            )
            for i, r in zip(plain, results, strict=True):
                out[i] = r
        for i, (u, state, ctx) in enumerate(zip(us, states, ctxs, strict=True)):
            if out[i] is None:
                out[i] = self.update(u, state, group, ctx)
        return out  # type: ignore[return-value]

    def second_moment_sum(self, state: State, group: Group) -> Tensor | None:
        if not self.quantized(state):
            return super().second_moment_sum(state, group)
        _, (v_key, v_signed) = self.QUANTIZED
        fp32 = {
            "adam.exp_avg_sq": self._load(state, v_key, v_signed),
            "adam.step": state["adam.step"],
        }
        return super().second_moment_sum(fp32, group)

    def reset(self, state: State, group: Group) -> None:
        if not self.quantized(state):
            super().reset(state, group)
            return
        for key, _ in self.QUANTIZED:  # codes and absmax 0 dequantize to 0
            state[key].zero_()
            state[key + ".absmax"].zero_()
        state["adam.step"].zero_()

    def rotate(self, state: State, rotate_fn: Callable[[Tensor, bool], Tensor]) -> None:
        if not self.quantized(state):
            super().rotate(state, rotate_fn)
            return
        fp32 = self._fp32_state(state)
        super().rotate(fp32, rotate_fn)  # second moment clamped at 0 there
        self._store_fp32_state(state, fp32)


__all__ = ["BLOCK", "MIN_8BIT_SIZE", "ScaleByAdam8bit"]
