"""``--optim.capture`` and the AdamW baseline's kernel (issue 38 item 8): capture runs the
non-refresh steps through galore2.CapturedStep on a GPU; on the CPU it is accepted and
every step runs eagerly, the optimizer checked all the same. ``--optimizer adamw`` is
torch's fused AdamW on CUDA, foreach elsewhere."""

from __future__ import annotations

import json

import pytest
import torch

from recipes import optimizers
from recipes.config import OptimConfig
from recipes.resolve import parse_args
from tests.recipes.test_recipe import run

CONSTANT_LR = ("--optim.warmup_ratio", "0", "--optim.min_lr_ratio", "1")


def test_capture_on_the_cpu_runs_the_capturable_steps_eagerly(tmp_path, capsys):
    captured = run(tmp_path / "capture", "--steps", "6", "--optim.capture", "true", *CONSTANT_LR)
    out = capsys.readouterr().out
    assert "optim.capture: CUDA graphs need a GPU; on cpu every step runs eagerly" in out
    config = json.loads((tmp_path / "capture" / "config.json").read_text())["optim"]
    assert config["capture"] is True and config["options"]["capturable"] is True
    eager = run(tmp_path / "eager", "--steps", "6", "--optim.capturable", "true", *CONSTANT_LR)
    assert [r["loss"] for r in captured] == [r["loss"] for r in eager]  # the same steps


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--optimizer", "adamw"], r"optim\.capture .* needs a galore2 optimizer"),
        (["--optim.capturable", "false"], r"optim\.capture needs optim\.capturable true"),
        (["--optim.per_layer", "true"], r"optim\.capture cannot replay optim\.per_layer"),
    ],
)
def test_capture_refusals_before_anything_is_built(tmp_path, argv, error):
    with pytest.raises(ValueError, match=error):
        parse_args(["--config", "tiny", "--out", str(tmp_path), "--optim.capture", "true",
                    *CONSTANT_LR, *argv])  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_capture_refuses_a_changing_lr_and_an_optimizer_that_cannot_replay(tmp_path):
    with pytest.raises(ValueError, match=r"constant learning rate.*--optim\.min_lr_ratio 1"):
        run(tmp_path / "sched", "--steps", "4", "--optim.capture", "true")
    with pytest.raises(ValueError, match=r"CapturedStep: .*random"):  # APOLLO's projector
        run(tmp_path / "apollo", "--steps", "4", "--optimizer", "apollo",
            "--optim.capture", "true", *CONSTANT_LR)  # fmt: skip


def test_adamw_kernel_fused_on_cuda_foreach_elsewhere():
    cfg = OptimConfig(name="adamw")
    assert optimizers.adamw_kernel(cfg, torch.device("cuda")) == {"fused": True}
    assert optimizers.adamw_kernel(cfg, torch.device("cpu")) == {"foreach": True}
    assert optimizers.adamw_label(cfg, torch.device("cuda")) == "torch AdamW (fused)"
    model = torch.nn.Linear(4, 4)
    opt = optimizers.build_optimizer(model, cfg, 10)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    cfg.adamw_kernel = "fused"
    assert optimizers.build_optimizer(model, cfg, 10).defaults["fused"] is True
    cfg.adamw_kernel = "foreach"
    assert optimizers.adamw_kernel(cfg, torch.device("cuda")) == {"foreach": True}


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--optim.adamw_kernel", "triton"], r"optim\.adamw_kernel must be one of auto, fused"),
        (["--optimizer", "galore_adamw", "--optim.adamw_kernel", "fused"],
         r"applies to --optimizer adamw only"),
    ],
)  # fmt: skip
def test_adamw_kernel_refusals(argv, error):
    with pytest.raises(ValueError, match=error):
        parse_args(["--config", "tiny", "--optimizer", "adamw", *argv])
