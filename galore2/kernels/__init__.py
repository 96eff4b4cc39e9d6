"""Fused Triton kernels for the GaLore step, with the torch code as fallback and reference.

* :mod:`galore2.kernels.adam8bit` — the 8-bit Adam update: dequantize both moments,
  update them, write the direction, requantize them blockwise (``ScaleByAdam8bit``).
* :mod:`galore2.kernels.lowrank` — the back-projection ``p ← decay·p − lr·scale·(A @ B)``
  as a matmul whose epilogue applies the update (``apply_update``).
* :mod:`galore2.kernels.hadamard` — the blockwise random Hadamard rotation of quantized
  bases (``rotate`` / ``unrotate``).

:mod:`galore2.kernels.dispatch` decides per call which runs (``GALORE2_KERNELS`` =
``auto`` | ``torch`` | ``triton``). Only the dispatch module is imported here: the kernel
modules import triton and are loaded on first use.
"""

from .dispatch import ENV_VAR, MODES, kernel_mode, triton_available, use_triton

__all__ = ["ENV_VAR", "MODES", "kernel_mode", "triton_available", "use_triton"]
