"""INT8 weights through the Hugging Face Trainer's checkpoints (issue 40): ``GaLoreTrainer``
saves the codes, scales and rounding counters in ``model.safetensors`` and a run resumed
from its checkpoint continues bit for bit."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

import galore2  # noqa: E402
from galore2.integrations.transformers import GaLoreTrainer  # noqa: E402
from tests.integrations.hf_cases import Motifs, losses, tiny_llama, training_args  # noqa: E402

SETTINGS = {"rank": 4, "update_proj_gap": 3}


def _model(perturbed: bool = False) -> torch.nn.Module:
    model = tiny_llama()
    if perturbed:  # other weights and other rounding seeds: the checkpoint must replace them
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
    galore2.quantize_weights(model, group_size=16, seed=1 if perturbed else 0)
    return model


def _trainer(out, model) -> transformers.Trainer:
    args = training_args(out, max_steps=8, save_strategy="steps", save_steps=4,
                         per_device_train_batch_size=4)  # fmt: skip
    return GaLoreTrainer(model, args, train_dataset=Motifs(), galore_settings=SETTINGS)


def test_trainer_checkpoint_keeps_codes_and_scales_and_resumes_bit_identically(tmp_path):
    straight = _trainer(tmp_path / "a", _model())
    straight.train()
    saved = tmp_path / "a" / "checkpoint-4" / "model.safetensors"
    with safetensors.safe_open(str(saved), "pt") as f:
        keys = set(f.keys())
        up = "model.layers.0.mlp.up_proj."
        assert {up + k for k in ("weight_codes", "weight_scales", "weight_seed",
                                 "weight_writes")} <= keys  # fmt: skip
        assert up + "weight" not in keys  # the one-element shell is not saved
        assert f.get_tensor(up + "weight_codes").dtype == torch.int8
        assert int(f.get_tensor(up + "weight_writes")) == 4

    resumed = _trainer(tmp_path / "b", _model(perturbed=True))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    a, b = losses(straight), losses(resumed)
    assert [b[s] for s in range(5, 9)] == [a[s] for s in range(5, 9)]
    want, got = straight.model.state_dict(), resumed.model.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert int(resumed.model.model.layers[0].mlp.up_proj.weight_writes) == 8
    state, ref = resumed.optimizer.state_dict()["state"], straight.optimizer.state_dict()["state"]
    assert state.keys() == ref.keys()
    for i, s in state.items():
        assert s.keys() == ref[i].keys() and all(torch.equal(s[k], ref[i][k]) for k in s), i
