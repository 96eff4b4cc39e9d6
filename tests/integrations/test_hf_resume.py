"""Resuming a Hugging Face Trainer run: settings that cannot change are refused, the run
continues exactly otherwise, on each way in (issue 16 item 3, the Trainer's side)."""

from __future__ import annotations

import pytest
import torch

from .hf_cases import (
    PATHS,
    SETTINGS,
    STRAIGHT,
    Motifs,
    losses,
    make_trainer,
    tiny_llama,
    training_args,
)

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


@pytest.mark.parametrize("path", PATHS)
def test_resume_continues_the_same_run(straight_runs, tmp_path, path):
    """30 steps straight == a new Trainer resumed from the straight run's step-20 checkpoint
    (as a job killed after it would leave it) for 10 more: bitwise the same losses of steps
    21-30, weights and optimizer state (gradient accumulation 2, refreshes at 0, 10, 20)."""
    straight = straight_runs[path]
    resumed = make_trainer(path, tiny_llama(), training_args(tmp_path, **STRAIGHT), **SETTINGS)
    resumed.train(resume_from_checkpoint=straight.checkpoint)
    a, b = losses(straight.trainer), losses(resumed)
    assert sorted(b) == list(range(1, 31))  # 1-20 from the checkpoint's trainer state
    assert [b[s] for s in range(21, 31)] == [a[s] for s in range(21, 31)]
    for (n, p), (_, q) in zip(
        resumed.model.named_parameters(), straight.trainer.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), n
    state = resumed.optimizer.state_dict()["state"]
    ref = straight.trainer.optimizer.state_dict()["state"]
    assert state.keys() == ref.keys()
    for i, s in state.items():
        assert s.keys() == ref[i].keys() and all(torch.equal(s[k], ref[i][k]) for k in s), i
    assert resumed.state.global_step == 30
