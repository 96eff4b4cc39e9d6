"""Will it fit? Per-GPU memory of training any causal LM with AdamW or galore2's optimizers.

    python -m galore2.plan CONFIG [--gpu-memory 24GB] [--world-size 1,8] [--batch-size 1]
        [--seq-len 2048] [--rank 1024] [--per-layer both] [--checkpointing both]
        [--json] [--plot out.png]

CONFIG is a Hugging Face ``config.json`` or its folder (:mod:`galore2.plan.configs`). The
model is built on the meta device: nothing is allocated and nothing is downloaded. The
planner is self-contained (it never imports the recipe of a source checkout): a recipe
config is planned by the recipe, which passes its resolved settings down,
``python -m recipes.plan llama_7b`` with the same options. Per optimizer — AdamW (torch's
fused and foreach kernels), 8-bit AdamW (bitsandbytes) and every galore2 preset:
GaLoreAdamW, GaLoreAdamW8bit with an INT8
and an INT4 basis, GaLoreAdafactor, Fira, APOLLO, APOLLO-Mini (rank 1), GaLoreMuon,
Ranger21 (full rank), GaLoreRanger21 (:data:`OPTIMIZERS`) — and per option set —
per-layer updates, activation checkpointing, FSDP world size — the plan lists weights,
gradients, optimizer state, the step's own memory, activations and the total per GPU,
and whether it fits
``--gpu-memory``. Its header counts the matrices GaLore projects (:func:`projected`: the
weights of ``nn.Linear`` and ``transformers``' ``Conv1D`` layers but the output head, or
the recipe's ``target_modules``), or says plainly that nothing is.

* optimizer state is **measured**: each galore2 optimizer is built over the meta model and
  ``init_state()`` creates every state tensor at its final shape
  (:mod:`galore2.plan.state`); AdamW and 8-bit AdamW are counted by their storage rules;
* the step's own memory is **measured**: two steps run on the meta device under a
  ``TorchDispatchMode`` that counts the bytes alive (:mod:`galore2.plan.step`);
* weights, gradients and activations come from the formulas of
  :mod:`galore2.plan.formulas` (its docstring writes them out), the one place they live:
  the recipe's ``python -m recipes.memory`` calls the same functions.

The Python API: :func:`plan` (rows for a model), :class:`Footprint` / :class:`Shapes` (the
formulas' inputs), :func:`activation_bytes`, :func:`parse_size`, :class:`Report`.
"""

from .formulas import Footprint, Shapes, activation_bytes, decoder_layers, layer_bytes
from .planner import OPTIMIZERS, Row, plan, projected, state_pieces, step_memory
from .report import Report
from .state import Piece, counted, measured, nbytes
from .step import StepMemory
from .units import parse_size

__all__ = [
    "OPTIMIZERS",
    "Footprint",
    "Piece",
    "Report",
    "Row",
    "Shapes",
    "StepMemory",
    "activation_bytes",
    "counted",
    "decoder_layers",
    "layer_bytes",
    "measured",
    "nbytes",
    "parse_size",
    "plan",
    "projected",
    "state_pieces",
    "step_memory",
]
