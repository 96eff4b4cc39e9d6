"""The three ways in, each trained once per session (30 steps, shared by several tests)."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

from .hf_cases import PATHS, SETTINGS, STRAIGHT, make_trainer, tiny_llama, training_args


class Run(NamedTuple):
    trainer: Any  # transformers.Trainer, trained
    given: Any  # the optimizer passed in ``optimizers=`` (None on the other paths)
    checkpoint: str  # saved at step 20 of the 30


@pytest.fixture(scope="session")
def straight_runs(tmp_path_factory) -> dict[str, Run]:
    """Each of :data:`PATHS`, uninterrupted: 30 steps of a tiny Llama with
    gradient_accumulation_steps=2 and :data:`SETTINGS`, a checkpoint saved at step 20."""
    runs = {}
    for path in PATHS:
        out = tmp_path_factory.mktemp(path)
        trainer = make_trainer(path, tiny_llama(), training_args(out, **STRAIGHT), **SETTINGS)
        given = trainer.optimizer
        trainer.train()
        runs[path] = Run(trainer, given, str(out / "checkpoint-20"))
    return runs
