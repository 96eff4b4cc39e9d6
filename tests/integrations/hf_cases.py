"""A tiny Llama, a synthetic dataset and the three ways to give a Trainer a galore2 optimizer,
shared by the Hugging Face integration tests (CPU, offline: the model is built from a config)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from galore2.integrations.transformers import (  # noqa: E402
    GaLoreTrainer,
    create_optimizer,
    optimizer_cls_and_kwargs,
)

RANK, VOCAB, SEQ = 8, 128, 32
#: the ways in: ``Trainer(optimizers=(create_optimizer(...), None))``, ``GaLoreTrainer``,
#: ``Trainer(optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(...))``
PATHS = ("optimizers", "GaLoreTrainer", "optimizer_cls_and_kwargs")
#: the settings and ``TrainingArguments`` overrides of the runs the paths are compared on
SETTINGS = {"rank": RANK, "update_proj_gap": 10}
STRAIGHT = {
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "save_strategy": "steps",
    "save_steps": 20,
}


def tiny_llama(bias: bool = False) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        attention_bias=bias,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class Motifs(torch.utils.data.Dataset):
    """Sequences that repeat a random motif of 3–7 tokens: learnable by copying from context."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        period = 3 + i % 5
        ids = torch.randint(0, VOCAB, (period,), generator=g).repeat(SEQ // period + 1)[:SEQ]
        return {"input_ids": ids, "labels": ids.clone()}


def training_args(tmp_path, **overrides) -> transformers.TrainingArguments:
    kwargs = {
        "output_dir": str(tmp_path),
        "max_steps": 30,
        "per_device_train_batch_size": 8,
        "learning_rate": 3e-3,
        "weight_decay": 0.1,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        **overrides,
    }
    return transformers.TrainingArguments(**kwargs)


def make_trainer(path: str, model: nn.Module, args, **settings) -> transformers.Trainer:
    """A Trainer on :class:`Motifs` whose optimizer is built with ``settings`` by ``path``."""
    data = {"train_dataset": Motifs()}
    if path == "optimizers":
        opt = create_optimizer(model, args, **settings)
        return transformers.Trainer(model, args, optimizers=(opt, None), **data)
    if path == "GaLoreTrainer":
        return GaLoreTrainer(model, args, galore_settings=settings, **data)
    if path == "optimizer_cls_and_kwargs":
        pair = optimizer_cls_and_kwargs(model, args, **settings)
        return transformers.Trainer(model, args, optimizer_cls_and_kwargs=pair, **data)
    raise ValueError(f"path must be one of {PATHS}, got {path!r}")


def losses(trainer: transformers.Trainer) -> dict[int, float]:
    """The logged training loss of each step."""
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
