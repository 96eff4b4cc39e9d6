"""Fused Triton kernels for the GaLore step, with the torch code as fallback and reference.

* :mod:`galore2.kernels.adam8bit` — the 8-bit Adam update: dequantize both moments,
  update them, write the direction, requantize them blockwise (``ScaleByAdam8bit``).
* :mod:`galore2.kernels.lowrank` — the back-projection ``p ← decay·p − lr·scale·(A @ B)``
  as a matmul whose epilogue applies the update (``apply_update``).
* :mod:`galore2.kernels.lowrank_list` — the same tile for every matrix of a shape batch in
  one launch: GaLore's projections and back-projections along the data, called through
  the custom ops ``galore2::mm_each_`` / ``addmm_each_`` of :mod:`galore2.kernels.ops_lowrank`.
* :mod:`galore2.kernels.scaled_list` — a shape batch's gradients scaled into their weights
  (APOLLO along the data) and their channel norms, one launch each: the custom ops
  ``galore2::scaled_add_each_`` / ``channel_norms_each`` of :mod:`galore2.kernels.ops_scaled`.
* :mod:`galore2.kernels.residual_list` — the channel norms of Fira's residuals G − P·R of a
  shape batch, tile by tile, never made (``galore2::residual_norms_each``); its update
  P·X + G ⊙ φ is ``lowrank_list``'s grouped matmul with the scaled gradient in its epilogue
  (``galore2::addmm_scaled_each_`` of :mod:`galore2.kernels.ops_lowrank`).
* :mod:`galore2.kernels.project_norms_list` — Fira's (APOLLO's) projection of a shape batch
  with the channel norms of its residuals (its gradients) and of R, each gradient read
  once (``galore2::project_norms_each`` of :mod:`galore2.kernels.ops_scaled`): what the
  grouped projection and ``residual_list`` (``channel_norms_each``) do in two passes.
* :mod:`galore2.kernels.hadamard` — the blockwise random Hadamard rotation of quantized
  bases (``rotate`` / ``unrotate``).
* :mod:`galore2.kernels.adamw` — AdamW of a bf16 weight with float32 moments in one pass
  (plain AdamW groups: ``ScaleByAdam.torch_adamw``), called through the custom op
  ``galore2::adamw_`` of :mod:`galore2.kernels.ops` (imported with galore2: no triton).

:mod:`galore2.kernels.dispatch` decides per call which runs (``GALORE2_KERNELS`` =
``auto`` | ``torch`` | ``triton``); every call site goes through its ``run_kernel``.
Only the dispatch module is imported here: the kernel modules import triton and are
loaded on first use (:mod:`galore2.kernels.blocks`, the Hadamard block layout shared with
the torch path, imports nothing).

This package is the bottom layer of galore2 (see ``[tool.importlinter]`` in
pyproject.toml): it imports nothing else from galore2, so its callers pass it local
tensors (a DTensor's ``to_local()``).
"""

from .dispatch import ENV_VAR, MODES, kernel_mode, triton_available, use_triton

__all__ = ["ENV_VAR", "MODES", "kernel_mode", "triton_available", "use_triton"]
