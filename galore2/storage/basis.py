"""How a GaLore basis is kept in the optimizer state: the ``basis_dtype`` group key.

A basis is a dense ``rows × r`` fp32 matrix (P: m×r under ``"proj.left"``, row-sharded
with its weight; Q: n×r under ``"proj.right"``, replicated). Its format is a
:class:`~galore2.storage.format.TensorFormat` (the storage protocol bases and moments
share): it allocates the state (:meth:`~TensorFormat.allocate`, logical shape
``(rows, r)``, the Plan as ``params``), writes a new basis into it
(:meth:`~TensorFormat.store`) and reads it back as a dense fp32 tensor
(:meth:`~TensorFormat.load`); nothing dense is kept for the quantized formats — they
are dequantized on every use.

* ``fp32`` — the basis itself under ``KEY`` (the default; unchanged behaviour).
* ``bf16`` — the basis rounded to bfloat16 (``.to(torch.bfloat16)``) under ``KEY``;
  2 bytes per entry. (Both: :class:`~galore2.storage.format.FloatFormat`.)
* ``int8`` / ``int4`` — blockwise symmetric absmax quantization under ``KEY.q``
  (codes) and ``KEY.scale`` (fp32 scales). Each row is cut along the rank axis into
  groups of ``basis_group_size`` consecutive entries; group j with absmax a_j gets
  the scale s_j = a_j / q_max (q_max = 127 / 7) and codes round(x / s_j) in
  [−q_max, q_max], so |x − s_j·code| ≤ s_j / 2. When the group size does not divide
  r the last group of a row is shorter (no padding). Rows quantize independently,
  so codes and scales shard on dim 0 exactly like the basis ("rows" for P,
  "replicate" for Q) and an FSDP run stores what one process stores. int8 keeps one
  int8 code per entry; int4 packs two codes per uint8 (code + 8 in a nibble, the
  even entry in the low nibble; an odd-length row gets one padding nibble). A group
  whose absmax is below fp32's smallest normal number times q_max stores scale 0
  (all codes 0).
* ``basis_hadamard=True`` (int8 / int4) rotates each row by H·D before quantizing
  (see :mod:`galore2.storage.hadamard`) and undoes it after dequantizing. The
  quantization groups are then the Hadamard blocks: full blocks of
  ``basis_group_size`` plus, when the block does not divide r, one tail block of the
  remaining t entries zero-padded to the next power of two — the stored codes cover
  the padded length (:func:`~galore2.storage.hadamard.padded_length`), an overhead
  of under t entries per row (e.g. r = 300, block 256: 320 codes, +6.7%; none when
  r is a multiple of the block or r < block is a power of two). The signs D are not
  stored: they are regenerated from the parameter's ``galore.seed`` (``Plan.basis_seed``),
  which never changes and is part of every checkpoint.

Bytes per row of r entries (k groups): fp32 4r, bf16 2r, int8 L + 4k, int4
⌈L/2⌉ + 4k, with L = r (plain) or the padded length (Hadamard).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor

from .._numerics import mix_seed
from ..core.options import Bool, Choice, CrossCheck, Int, Option
from .format import BF16, FP32, Spec, TensorFormat, Zeros
from .hadamard import next_power_of_two, padded_length, random_signs, rotate, unrotate

if TYPE_CHECKING:
    from ..placement import Placement

State = dict[str, Tensor]


class Plan(Protocol):
    """What a format reads of the basis it stores: its rank, device and placement, and the
    group's storage settings. :class:`galore2.projectors.base.Plan` is one (this layer
    sits below the projectors and does not import them)."""

    @property
    def rank(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def placement(self) -> Placement: ...  # how the basis is distributed
    @property
    def group_size(self) -> int: ...  # basis_group_size: quantization group, Hadamard block
    @property
    def hadamard(self) -> bool: ...  # basis_hadamard: rotate rows before quantizing
    @property
    def basis_seed(self) -> int: ...  # the Hadamard signs derive from it


_SALT = {"proj.left": 1, "proj.right": 2}  # P and Q get independent Hadamard signs


def _salt(key: str) -> int:
    """Per-key salt of the Hadamard signs (other keys, e.g. Tucker modes: a CRC of the key)."""
    return _SALT.get(key) or zlib.crc32(key.encode())


_TINY = torch.finfo(torch.float32).tiny


BasisFormat = TensorFormat  # a basis's format is a storage format (kept name)


@dataclass(frozen=True)
class Quantization:
    """The ``params`` of a quantized basis format when no Plan is at hand (byte counts)."""

    group_size: int = 256
    hadamard: bool = False


def basis_zeros(plan: Plan) -> Zeros:
    """Allocates a basis's state tensors on the plan's device and placement."""

    def zeros(shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> Tensor:
        return plan.placement.zeros(shape, dtype, plan.device, layout)

    return zeros


class QuantizedBasis(TensorFormat):
    """Blockwise symmetric absmax quantization (see the module docstring)."""

    bits: ClassVar[int] = 8
    code_dtype: ClassVar[torch.dtype] = torch.int8
    suffixes = (".q", ".scale")

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    # ---- layout ------------------------------------------------------------------
    @staticmethod
    def groups(rank: int, group_size: int, hadamard: bool) -> tuple[int, int]:
        """(full groups per row, length of the last, shorter group — 0 if none), in the
        stored (padded, for Hadamard) row."""
        full = rank // group_size
        tail = rank - full * group_size
        if hadamard and tail:
            tail = next_power_of_two(tail)
        return full, tail

    @staticmethod
    def length(rank: int, group_size: int, hadamard: bool) -> int:
        """Codes per row: r, or the padded length when rotating."""
        return padded_length(rank, group_size) if hadamard else rank

    def code_columns(self, length: int) -> int:
        return length if self.bits == 8 else (length + 1) // 2

    # ---- state -------------------------------------------------------------------
    def specs(self, shape: tuple[int, ...], layout: str, params: Any = None) -> dict[str, Spec]:
        """Codes ``(rows, columns)`` and fp32 scales ``(rows, groups)`` of a ``rows × rank``
        basis; ``params`` (a Plan or :class:`Quantization`) gives the group size and rotation."""
        rows, rank = shape
        g = getattr(params, "group_size", 256)
        had = getattr(params, "hadamard", False)
        full, tail = self.groups(rank, g, had)
        columns = self.code_columns(self.length(rank, g, had))
        k = full + (1 if tail else 0)
        return {
            ".q": Spec((rows, columns), self.code_dtype, layout),
            ".scale": Spec((rows, k), torch.float32, layout),
        }

    def store(self, state: State, key: str, basis: Tensor, plan: Any = None) -> None:
        codes, scales = self.encode(basis, plan, _salt(key))
        self._check(state, key, plan)
        state[key + ".q"].copy_(codes)
        state[key + ".scale"].copy_(scales)

    def load(self, state: State, key: str, plan: Any = None) -> Tensor | None:
        if key + ".q" not in state:
            return None
        self._check(state, key, plan)
        return self.decode(state[key + ".q"], state[key + ".scale"], plan, _salt(key))

    def _check(self, state: State, key: str, plan: Plan) -> None:
        """A clear error when the stored codes do not fit this format (e.g. a checkpoint
        saved with another basis_dtype / basis_group_size / basis_hadamard)."""
        q, s = state.get(key + ".q"), state.get(key + ".scale")
        full, tail = self.groups(plan.rank, plan.group_size, plan.hadamard)
        columns = self.code_columns(self.length(plan.rank, plan.group_size, plan.hadamard))
        k = full + (1 if tail else 0)
        if (
            q is None
            or s is None
            or q.dtype != self.code_dtype
            or q.dim() != 2
            or q.shape[1] != columns
            or s.shape[1:] != (k,)
        ):
            got = "missing" if q is None or s is None else f"{q.dtype} {tuple(q.shape)}"
            raise ValueError(
                f"optimizer state {key!r} does not hold a basis_dtype={self.name!r} basis "
                f"with rank {plan.rank}, basis_group_size={plan.group_size}, "
                f"basis_hadamard={plan.hadamard} (expected {self.code_dtype} codes with "
                f"{columns} columns and {k} scales per row, got {got}); resume with the "
                "settings the checkpoint was saved with"
            )

    # ---- encode / decode -----------------------------------------------------------
    def signs(self, plan: Plan, salt: int, length: int, device: torch.device) -> Tensor:
        return random_signs(mix_seed(plan.basis_seed, salt), length, device)

    def encode(
        self, basis: Tensor, plan: Plan, salt: int = 0, noise: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(codes as stored, fp32 scales rows × k) of a dense ``rows × r`` basis.

        Codes round to nearest; with ``noise`` (uniform in [0, 1), the stored row length,
        no Hadamard rotation) they round stochastically, ``floor(x / s + u)``: unbiased,
        E[s·code] = x (what quantized weights use, :mod:`galore2.storage.weights`)."""
        if noise is not None and plan.hadamard:
            raise ValueError("stochastic rounding (noise) is not defined with basis_hadamard")
        x = basis.float()
        rows, r = x.shape
        g, had = plan.group_size, plan.hadamard
        full, tail = self.groups(r, g, had)
        if had:
            L = self.length(r, g, had)
            x = torch.nn.functional.pad(x, (0, L - r))
            x = rotate(x, g, self.signs(plan, salt, L, x.device))
        codes, scales = [], []
        noises = _pieces(noise, full, g, tail) if noise is not None else None
        for n, piece in enumerate(_pieces(x, full, g, tail)):
            amax = piece.abs().amax(dim=-1, keepdim=True)
            ok = amax >= _TINY * self.qmax
            scale = torch.where(ok, amax / self.qmax, torch.zeros_like(amax))
            c = piece / torch.where(ok, scale, torch.ones_like(scale))
            c = torch.round(c) if noises is None else torch.floor(c.add_(noises[n]))
            codes.append(c.clamp_(-self.qmax, self.qmax).reshape(rows, c.shape[1] * c.shape[2]))
            scales.append(scale.reshape(rows, c.shape[1]))
        return self.pack(torch.cat(codes, dim=1)), torch.cat(scales, dim=1)

    def decode(self, codes: Tensor, scales: Tensor, plan: Plan, salt: int = 0) -> Tensor:
        """The dense fp32 ``rows × r`` basis from stored codes and scales."""
        r, g, had = plan.rank, plan.group_size, plan.hadamard
        full, tail = self.groups(r, g, had)
        L = self.length(r, g, had)
        q = self.unpack(codes, L)
        rows = q.shape[0]
        parts = []
        if full:
            head = q[:, : full * g].reshape(rows, full, g) * scales[:, :full, None]
            parts.append(head.reshape(rows, full * g))
        if tail:
            parts.append(q[:, full * g :] * scales[:, full:])
        x = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        if had:
            x = unrotate(x, g, self.signs(plan, salt, L, x.device))[:, :r]
        return x

    def pack(self, codes: Tensor) -> Tensor:
        """Integer-valued fp32 codes → the stored tensor."""
        if self.bits == 8:
            return codes.to(torch.int8)
        u = (codes + 8).to(torch.uint8)
        if u.shape[1] % 2:
            u = torch.nn.functional.pad(u, (0, 1), value=8)
        return u[:, 0::2] | (u[:, 1::2] << 4)

    def unpack(self, stored: Tensor, length: int) -> Tensor:
        """The stored tensor → fp32 codes (rows × length)."""
        if self.bits == 8:
            return stored.float()
        lo, hi = stored & 0xF, stored >> 4
        both = torch.stack((lo, hi), dim=2).reshape(stored.shape[0], 2 * stored.shape[1])
        both = both[:, :length]
        return both.float() - 8.0


class Int8Basis(QuantizedBasis):
    name = "int8"
    bits = 8
    code_dtype = torch.int8


class Int4Basis(QuantizedBasis):
    name = "int4"
    bits = 4
    code_dtype = torch.uint8


def _pieces(x: Tensor, full: int, g: int, tail: int) -> list[Tensor]:
    """Views of a rows × L tensor as (rows, full, g) groups and one (rows, 1, tail) group."""
    rows = x.shape[0]
    out = []
    if full:
        out.append(x[:, : full * g].reshape(rows, full, g))
    if tail:
        out.append(x[:, full * g :].reshape(rows, 1, tail))
    return out


FORMATS: dict[str, TensorFormat] = {f.name: f for f in (FP32, BF16, Int8Basis(), Int4Basis())}
KEY_SUFFIXES = tuple(sorted({s for f in FORMATS.values() for s in f.suffixes if s}))


def basis_format(name: str) -> TensorFormat:
    """The format of a group's ``basis_dtype`` (validated earlier by the optimizer)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"basis_dtype must be one of {tuple(FORMATS)}, got {name!r}") from None


__all__ = [
    "FORMATS",
    "BasisFormat",
    "Int4Basis",
    "Int8Basis",
    "Quantization",
    "QuantizedBasis",
    "basis_format",
    "basis_zeros",
]


# ---- the options that choose a basis's storage (read by GaLore's projectors) ----------
BASIS_DTYPE = Option(
    "basis_dtype",
    "fp32",
    Choice(("fp32", "bf16", "int8", "int4"),
           {"float32": "fp32", "bfloat16": "bf16", torch.float32: "fp32", torch.bfloat16: "bf16"}),
    "how the basis is stored; int8 / int4 are blockwise absmax codes, dequantized on use", resumable=False
)  # fmt: skip
BASIS_GROUP_SIZE = Option(
    "basis_group_size",
    256,
    Int(low=2),
    "elements per quantization block of an int8 / int4 basis",
    resumable=False,
)
BASIS_HADAMARD = Option(
    "basis_hadamard",
    False,
    Bool(),
    "rotate each block by a seeded random Hadamard matrix before quantizing (int8 / int4)",
    resumable=False,
)
OPTIONS = (BASIS_DTYPE, BASIS_GROUP_SIZE, BASIS_HADAMARD)


def validate_basis_options(group: dict) -> None:
    """Checks that involve two basis options (single-key checks ran already)."""
    name, size = group["basis_dtype"], group["basis_group_size"]
    if group["basis_hadamard"] and name not in ("int8", "int4"):
        raise ValueError(
            f"basis_hadamard=True needs basis_dtype 'int8' or 'int4' (it rotates before "
            f"quantizing), got basis_dtype={name!r}"
        )
    if group["basis_hadamard"] and size & (size - 1):
        raise ValueError(
            f"basis_group_size must be a power of two when basis_hadamard=True, got {size}"
        )


#: the basis storage's check across keys (GaLore runs it)
CHECKS = (
    CrossCheck(("basis_dtype", "basis_group_size", "basis_hadamard"), validate_basis_options),
)
