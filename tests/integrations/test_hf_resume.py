"""Resuming a Hugging Face Trainer run: settings that cannot change are refused, the run
continues exactly otherwise (issue 16 item 3, the Trainer's side)."""

from __future__ import annotations

import pytest
import torch

import galore2

from .test_hf_trainer import Motifs, tiny_llama, training_args

transformers = pytest.importorskip("transformers")

from galore2.integrations.transformers import GaLoreTrainer  # noqa: E402


def trainer(tmp_path, steps: int, **settings) -> transformers.Trainer:
    args = training_args(
        tmp_path, max_steps=steps, save_strategy="steps", save_steps=4, logging_steps=1
    )
    return GaLoreTrainer(
        tiny_llama(),
        args,
        train_dataset=Motifs(),
        galore_settings={"rank": 4, "update_proj_gap": 3, **settings},
    )


def test_resume_with_another_rank_is_refused_naming_it(tmp_path):
    trainer(tmp_path, 4).train()
    with pytest.raises(ValueError, match=r"rank: checkpoint 4, this optimizer 2"):
        trainer(tmp_path, 8, rank=2).train(resume_from_checkpoint=True)


def test_resume_continues_the_same_run(tmp_path):
    """8 steps straight == 4 steps, save, resume for 4 more (losses of steps 5-8 identical)."""
    straight = trainer(tmp_path / "a", 8)
    straight.train()
    first = trainer(tmp_path / "b", 8)
    first.args.max_steps = 4  # stop after step 4 (the checkpoint), as a killed job would
    first.train()
    resumed = trainer(tmp_path / "b", 8)
    resumed.train(resume_from_checkpoint=True)

    def losses(t):
        return {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}

    a, b = losses(straight), losses(resumed)
    assert [s for s in b if s > 4] == [5, 6, 7, 8]
    assert [a[s] for s in (5, 6, 7, 8)] == pytest.approx([b[s] for s in (5, 6, 7, 8)], rel=1e-5)
    opt = resumed.optimizer.optimizer
    assert isinstance(opt, galore2.GaLoreAdamW)
    assert all(g["rank"] in (4, None) for g in opt.param_groups)
    assert torch.isfinite(
        torch.stack([p.detach().norm() for p in resumed.model.parameters()])
    ).all()
