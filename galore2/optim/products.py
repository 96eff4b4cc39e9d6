"""How a rule's float32 matmuls run in a step of 16-bit tensors on an accelerator.

Some rules keep float32 products outside galore2's kernels: Fira's residual G − P·R and its
update P·N where the matrices do not go along the data (refresh steps, sharded matrices,
Llama-7B's, too large to batch), Muon's Newton–Schulz iteration on its float32 momentum.
On an H100 float32 FMA runs at 67 TFLOP/s against TF32's 494 on the tensor cores, and at
Llama-7B widths these products bound the step (``python -m benchmarks.run --tasks
roofline``). Where the step's tensors are 16-bit anyway — bf16 or fp16 gradients, whose
values TF32 holds exactly — and galore2's ops run (:data:`galore2.kernels.ops.FUSED_OP_DEVICES`:
CUDA; meta counts that step), :func:`fast_float32` allows TF32 around them: their other
operands (a float32 basis, a momentum) are rounded to TF32's 10 mantissa bits, more than the
along-data kernels' bf16 operands keep (8) and than torch.optim.Muon's bf16 Newton–Schulz.
Elsewhere it leaves torch's setting alone: the CPU keeps its float32 arithmetic, and a
float32 step its precision.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor

from ..kernels import ops
from ..projectors.base import tf32_matmuls

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def fast_float32(t: Tensor) -> AbstractContextManager:
    """The context of float32 matmuls in a step of tensors like ``t`` (see the module
    docstring): TF32 allowed where ``t`` is 16-bit on a device where galore2's ops run,
    else none."""
    if t.dtype in _SIXTEEN_BIT and t.device.type in ops.FUSED_OP_DEVICES:
        return tf32_matmuls(True)
    return nullcontext()


__all__ = ["fast_float32"]
