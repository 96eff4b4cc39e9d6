"""Linear weights kept as int8 codes + fp32 scales, rewritten with stochastic rounding.

A :class:`QuantizedLinear` is an ``nn.Linear`` (its class swapped in place by
:func:`galore2.quantize_weights`) whose weight is stored in the ``int8`` absmax format of
:mod:`galore2.storage.basis` — the format GaLore bases use, not a second quantizer: each
row (output channel) is cut into groups of ``group_size`` consecutive inputs, group j
keeps one fp32 scale s_j = absmax_j / 127 and int8 codes in [−127, 127]
(``group_size = in_features``: one scale per output channel).

What the module holds (all in its ``state_dict``, plain tensors, so
``torch.load(weights_only=True)`` reads a checkpoint):

* ``weight_codes`` (int8, out × in) and ``weight_scales`` (fp32, out × groups): the weight;
* ``weight_seed`` and ``weight_writes`` (0-d int64, kept on the CPU): the seed of this
  weight's rounding noise and how many times it was written — write t draws its noise from
  a generator seeded with ``mix_seed(seed, t)``, so a run resumed from a checkpoint draws
  the same noise as an uninterrupted one (bit-identical on the same device type);
* ``weight``: a *shell* ``nn.Parameter`` of the logical shape and the training dtype whose
  storage is one element (stride 0). It is what optimizers and hooks see: its ``.grad`` is
  the gradient of the dequantized weight (dense, training dtype), as for a plain Linear.
  It is not in the ``state_dict``.

Forward and backward dequantize the weight on the fly (:class:`_QuantizedLinearFn`: only the
codes and scales are saved for backward, no dense copy lives between them). The optimizer's
apply stage (:mod:`galore2.core.stored`) finds the :class:`Int8WeightStore` on the shell
(under ``STORE_ATTR``), updates a dense fp32 copy (:meth:`Int8WeightStore.dequantize`) and
hands it back to :meth:`Int8WeightStore.write`, which re-quantizes it by stochastic
rounding — codes
``floor(x / s + u)``, u uniform in [0, 1): E[s·code] = x, so an update smaller than a
quantization step still moves the weight in expectation. A write whose values are not all
finite leaves the codes and scales as they were (decided on the device, no host read).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .._numerics import generator_for, mix_seed
from ..core.stored import STORE_ATTR
from .basis import Int8Basis

INT8 = Int8Basis()


@dataclass(frozen=True)
class Layout:
    """The ``params`` the absmax format reads: codes per row and the group size."""

    rank: int  # in_features: codes per row
    group_size: int
    hadamard: bool = False


#: elements per block of rows of a dequantize / write / assign: the temporaries of one
#: block (≈ 17 bytes per element while encoding) are all that is transient besides the
#: dense tensor itself. Fewer, larger blocks on accelerators (fewer kernel launches). The
#: blocks cut the noise stream, so they are part of what makes a write reproducible: the
#: same on every run on the same device type.
_BLOCK = {"cpu": 1 << 20}
_BLOCK_ACCELERATOR = 1 << 24


def _row_blocks(rows: int, cols: int, device: torch.device) -> list[slice]:
    step = max(1, _BLOCK.get(device.type, _BLOCK_ACCELERATOR) // max(cols, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def dequantize(
    codes: Tensor, scales: Tensor, layout: Layout, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The dense weight of ``codes`` and ``scales`` in ``dtype`` (decoded in fp32 by the
    basis format, a block of rows at a time)."""
    rows = codes.shape[0]
    out = torch.empty((rows, layout.rank), dtype=dtype, device=codes.device)
    for b in _row_blocks(rows, layout.rank, codes.device):
        out[b] = INT8.decode(codes[b], scales[b], layout)
    return out


class _QuantizedLinearFn(torch.autograd.Function):
    """``F.linear(x, dequantize(codes, scales), bias)`` whose backward dequantizes again
    (codes and scales saved, not the dense weight); the weight's gradient goes to ``shell``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, shell: Tensor, codes: Tensor, scales: Tensor,
                bias: Tensor | None, layout: Layout) -> Tensor:  # fmt: skip
        w = dequantize(codes, scales, layout, shell.dtype)
        ctx.save_for_backward(x, codes, scales)
        ctx.layout, ctx.dtype, ctx.has_bias = layout, shell.dtype, bias is not None
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, codes, scales = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g @ dequantize(codes, scales, ctx.layout, g.dtype)
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            gw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(g.dtype)).to(ctx.dtype)
        if ctx.has_bias and ctx.needs_input_grad[4]:
            gb = g2.sum(0)
        return gx, gw, None, None, gb, None


class Int8WeightStore:
    """A :class:`QuantizedLinear`'s weight as the optimizer's apply stage sees it."""

    def __init__(self, module: QuantizedLinear) -> None:
        self.module = module

    def dequantize(self) -> Tensor:
        """A dense fp32 copy of the weight (the optimizer updates it, then :meth:`write`)."""
        m = self.module
        return dequantize(m.weight_codes, m.weight_scales, m.layout)

    @torch.no_grad()
    def assign(self, x: Tensor) -> None:
        """Set the weight to dense ``x`` rounded to nearest (a new weight: quantization, a
        recipe's initialization); the write counter is left as it is."""
        m = self.module
        for b in _row_blocks(x.shape[0], x.shape[1], x.device):
            m.weight_codes[b], m.weight_scales[b] = INT8.encode(x[b], m.layout)

    @torch.no_grad()
    def write(self, x: Tensor) -> None:
        """Re-quantize ``x`` (the updated dense weight) with stochastic rounding, seeded by
        (``weight_seed``, ``weight_writes``); nothing is written unless ``x`` is finite."""
        m = self.module
        step = int(m.weight_writes)  # a CPU counter: no device read
        gen = generator_for(x.device, mix_seed(int(m.weight_seed), step))
        blocks = _row_blocks(x.shape[0], x.shape[1], x.device)
        ok = torch.stack([torch.isfinite(x[b]).all() for b in blocks]).all()  # on the device
        for b in blocks:  # the noise of block i follows block i−1's in one stream
            noise = torch.rand(x[b].shape, generator=gen, device=x.device, dtype=torch.float32)
            codes, scales = INT8.encode(x[b], m.layout, noise=noise)
            m.weight_codes[b] = torch.where(ok, codes, m.weight_codes[b])
            m.weight_scales[b] = torch.where(ok, scales, m.weight_scales[b])
        m.weight_writes.fill_(step + 1)

    def tensors(self) -> tuple[Tensor, ...]:
        """What is stored: codes and scales (the planner counts them)."""
        return (self.module.weight_codes, self.module.weight_scales)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _shell(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``shape`` backed by one element (stride 0): what the parameter holds."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


class QuantizedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is int8 codes + scales (see the module docstring).

    Made by :meth:`convert` (the class of an existing ``nn.Linear`` swapped in place, so
    references to the module and ``isinstance(m, nn.Linear)`` still hold)."""

    weight_codes: Tensor
    weight_scales: Tensor
    weight_seed: Tensor
    weight_writes: Tensor
    layout: Layout

    @classmethod
    def convert(cls, module: nn.Linear, group_size: int | None, seed: int) -> QuantizedLinear:
        """Quantize ``module``'s weight (round to nearest) and swap its class."""
        w = module.weight
        out_f, in_f = w.shape
        layout = Layout(in_f, in_f if group_size is None else min(group_size, in_f))
        dtype, device, requires_grad = w.dtype, w.device, w.requires_grad
        module.__class__ = cls
        module.layout = layout
        k = INT8.specs((out_f, in_f), "rows", layout)[".scale"].shape[1]
        codes = torch.empty(out_f, in_f, dtype=torch.int8, device=device)
        module.register_buffer("weight_codes", codes)
        module.register_buffer("weight_scales", torch.empty(out_f, k, device=device))
        module.register_buffer("weight_seed", torch.tensor(seed, dtype=torch.int64))
        module.register_buffer("weight_writes", torch.tensor(0, dtype=torch.int64))
        # replaces the parameter where it was: the parameters' order (and so an optimizer's
        # indices) is the dense model's
        module.weight = nn.Parameter(_shell((out_f, in_f), dtype, device), requires_grad)
        module._attach()
        getattr(module.weight, STORE_ATTR).assign(w.detach())
        return module  # type: ignore[return-value]

    def _attach(self) -> None:
        setattr(self.weight, STORE_ATTR, Int8WeightStore(self))

    def forward(self, x: Tensor) -> Tensor:
        return _QuantizedLinearFn.apply(
            x, self.weight, self.weight_codes, self.weight_scales, self.bias, self.layout
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight=int8, group_size={self.layout.group_size}"

    # ---- what nn.Module does to parameters and buffers -------------------------------
    def _apply(self, fn: Any, recurse: bool = True) -> QuantizedLinear:
        """``.to()`` / ``.cuda()`` / ``.bfloat16()``: codes move, scales stay fp32, the
        counters stay on the CPU and the shell stays one element (in the new dtype)."""
        kept = self.weight_scales, self.weight_seed, self.weight_writes
        super()._apply(fn, recurse)
        device = self.weight_codes.device
        if self.weight_scales.dtype != torch.float32:  # cast by .to(dtype): the fp32 values
            self.weight_scales = kept[0].to(device)
        self.weight_seed, self.weight_writes = kept[1:]  # CPU counters, never converted
        w = self.weight
        w.data = _shell(tuple(w.shape), w.dtype, device)
        self._attach()  # a new Parameter object when torch overwrites parameters
        return self

    def __deepcopy__(self, memo: dict) -> QuantizedLinear:
        """A copy with its own codes, scales, counters and a one-element shell bound to it
        (torch's ``Parameter.__deepcopy__`` would clone the shell dense, without its store)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        w = self.weight
        memo[id(w)] = nn.Parameter(_shell(tuple(w.shape), w.dtype, w.device), w.requires_grad)
        for key, value in self.__dict__.items():
            object.__setattr__(new, key, copy.deepcopy(value, memo))
        new._attach()
        return new

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination.pop(prefix + "weight", None)  # the shell: nothing to save

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        if prefix + "weight" in state_dict and prefix + "weight_codes" not in state_dict:
            error_msgs.append(
                f"{prefix}weight: a dense weight for an int8-quantized layer; load the "
                "checkpoint before galore2.quantize_weights, then quantize"
            )
            return
        params = self._parameters
        kept = dict(params)
        params.pop("weight")  # the shell is not loaded (nor reported missing)
        try:
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                error_msgs,
            )  # fmt: skip
        finally:
            params.clear()
            params.update(kept)  # the same order: the optimizer's parameter indices hold


__all__ = ["Layout", "QuantizedLinear", "Int8WeightStore", "dequantize"]
