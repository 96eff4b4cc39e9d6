"""Which implementation runs a fused step: the torch path or a Triton kernel.

The choice is made per call from the environment variable ``GALORE2_KERNELS``
(read every time, so tests and scripts can change it between steps):

* ``auto`` (default) — the Triton kernel when every tensor involved is a plain
  (non-DTensor) tensor on an NVIDIA GPU of compute capability 8.0 or newer (Ampere
  onwards: the kernels' bf16 matmul needs it) and ``import triton`` works; the torch
  path otherwise. CPU tensors always take the torch path.
  A kernel module may opt out of ``auto`` with ``AUTO = False`` when it measured slower
  than its torch path (``lowrank``: cuBLAS' ``addmm_`` beat it on an H100, BENCHMARKS.md
  "Triton kernels (GPU)").
* ``torch`` — always the torch path (the reference implementation).
* ``triton`` — the Triton kernel wherever one applies; a :class:`RuntimeError` when
  it cannot run: triton is not importable, or a tensor is a DTensor, or a tensor is
  not on CUDA while Triton's interpreter (``TRITON_INTERPRET=1``) is off. Under the
  interpreter the kernels run, slowly, on CPU tensors (how the tests check them).

Kernels apply to the inputs they were written for (e.g. fp32 rows for the
Hadamard transform); other inputs take the torch path in every mode — each call
site asks its kernel module's ``supported(...)`` after :func:`use_triton` (both through
:func:`run_kernel`, the dispatch sequence every call site uses).

In ``auto`` mode a kernel that fails to compile or launch (a Triton / driver version
it was not built for, too little shared memory on a smaller GPU) is switched off for
the rest of the process with one warning and the torch path runs instead
(:func:`launch`); in ``triton`` mode the error propagates. Kernels fail before
writing anything (compilation precedes the launch), so the fallback starts from
untouched inputs.

Nothing here imports triton until a CUDA tensor (or ``GALORE2_KERNELS=triton``)
asks for it, so ``import galore2`` works without triton installed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")
ENV_VAR = "GALORE2_KERNELS"
MODES = ("auto", "torch", "triton")
_TRUE = ("1", "true", "on", "yes", "y")


def kernel_mode() -> str:
    """The mode requested by ``GALORE2_KERNELS`` (``auto`` when unset or empty)."""
    raw = os.environ.get(ENV_VAR, "")
    mode = raw.strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={raw!r} is not one of {', '.join(MODES)} (default auto)")
    return mode


@functools.cache
def triton_import_error() -> str | None:
    """Why ``import triton`` fails (None when it works); tried once per process."""
    try:
        import triton  # noqa: F401
    except Exception as err:  # ImportError, or a broken install failing at import time
        return f"{type(err).__name__}: {err}"
    return None


def triton_available() -> bool:
    return triton_import_error() is None


def interpreter_enabled() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET``, parsed as triton does)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


@functools.cache
def _capable(index: int) -> bool:
    """An NVIDIA GPU (not ROCm) of compute capability ≥ 8.0."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (8, 0)


def _is_distributed(t: Tensor) -> bool:
    """A guard, not a detector: callers hand the kernels local tensors (what
    ``Placement.local`` returns), so this only turns a caller's mistake into the torch
    path (``auto``) or a clear error (``triton``). DTensors are detected by
    :func:`galore2.fsdp.detect.is_dtensor`; this package is the bottom layer and may not
    import :mod:`galore2.fsdp`, hence the duck-typed test — the one outside galore2.fsdp."""
    return hasattr(t, "to_local")  # DTensor (and a Parameter holding one)


_PLAIN = (Tensor, torch.nn.Parameter)


def _local_cuda(tensors: tuple[Tensor, ...]) -> bool:
    """Every tensor a local (not distributed) CUDA tensor on a capable GPU: one pass,
    each device's capability looked up once in a row (a step's lists hold hundreds)."""
    last = None
    for t in tensors:
        device = t.device
        if device.type != "cuda" or (type(t) not in _PLAIN and _is_distributed(t)):
            return False
        if device.index != last:
            if not _capable(device.index or 0):
                return False
            last = device.index
    return True


def use_triton(*tensors: Tensor) -> bool:
    """Whether the Triton kernel should run on ``tensors`` (see the module docstring).

    Raises ValueError for a bad ``GALORE2_KERNELS`` and RuntimeError when it is
    ``triton`` and the kernel cannot run on these tensors.
    """
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "auto":  # one walk of the tensors, stopped at the first that fails
        return _local_cuda(tensors) and triton_available()
    cuda = all(t.device.type == "cuda" for t in tensors)
    plain = all(type(t) in _PLAIN or not _is_distributed(t) for t in tensors)
    error = triton_import_error()
    if error is not None:
        raise RuntimeError(
            f"{ENV_VAR}=triton but triton cannot be imported ({error}); install triton "
            f"(pip install triton) or set {ENV_VAR}=auto or torch"
        )
    if not plain:
        raise RuntimeError(
            f"{ENV_VAR}=triton but a tensor is a DTensor; the Triton kernels take local "
            f"tensors — set {ENV_VAR}=auto to use the torch path there"
        )
    if not cuda and not interpreter_enabled():
        devices = sorted({str(t.device) for t in tensors})
        raise RuntimeError(
            f"{ENV_VAR}=triton but the tensors are on {', '.join(devices)}: the Triton "
            "kernels run on CUDA tensors (or on CPU tensors under Triton's interpreter, "
            f"TRITON_INTERPRET=1); set {ENV_VAR}=auto or torch"
        )
    return True


_DISABLED: dict[str, str] = {}  # kernel name → why it was switched off (auto mode)


def disabled_kernels() -> dict[str, str]:
    """Kernels switched off in this process after a failure in ``auto`` mode, with why."""
    return dict(_DISABLED)


def launch(name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """``fn(*args, **kwargs)`` — a kernel launch — or None when the caller should take the
    torch path: kernel ``name`` was switched off earlier, or it raises now in ``auto``
    mode (then it is switched off with a :class:`RuntimeWarning` naming the error).
    In ``triton`` mode errors propagate."""
    auto = kernel_mode() == "auto"
    if auto and name in _DISABLED:
        return None
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        if not auto:
            raise
        _DISABLED[name] = f"{type(err).__name__}: {err}"
        warnings.warn(
            f"galore2: the Triton kernel {name!r} failed ({type(err).__name__}: {err}); "
            f"using the torch path for it from now on (set {ENV_VAR}=triton to raise instead, "
            f"or {ENV_VAR}=torch to skip Triton)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def run_kernel(
    name: str,
    *tensors: Tensor,
    supported: Callable[[ModuleType], bool],
    kernel: Callable[[ModuleType], Callable[[], T]],
) -> T | None:
    """The result of Triton kernel ``name`` (module ``galore2.kernels.<name>``) on
    ``tensors``, or None when the caller should take its torch path.

    The one dispatch sequence every call site shares: :func:`use_triton` on ``tensors``
    (may raise in ``triton`` mode); the kernel module imported lazily (it imports triton);
    ``supported(module)`` — inputs the kernel was written for; ``kernel(module)`` builds the
    launch (arguments evaluated there, outside the error handling, e.g. with
    :func:`functools.partial`) and :func:`launch` runs it under kernel ``name``'s
    switch-off-on-failure rule.
    """
    if not use_triton(*tensors):
        return None
    module = importlib.import_module(f"{__package__}.{name}")
    if kernel_mode() == "auto" and not getattr(module, "AUTO", True):
        return None  # measured slower than the torch path: only GALORE2_KERNELS=triton runs it
    if not supported(module):
        return None
    return launch(name, kernel(module))


def launch_device(t: Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s CUDA device current for a kernel launch (Triton launches on the current
    device, which need not be the tensors'); a no-op for CPU tensors (the interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


__all__ = [
    "ENV_VAR",
    "MODES",
    "disabled_kernels",
    "interpreter_enabled",
    "kernel_mode",
    "launch",
    "launch_device",
    "run_kernel",
    "triton_available",
    "triton_import_error",
    "use_triton",
]
