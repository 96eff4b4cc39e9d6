"""The CPU-runnable parts of benchmarks/torchtitan_gpu.py (issue 28 item 5): the offline
assets torchtitan's debug config reads, the command through torchtitan's own parser, and
the checks on its logs. The training runs themselves need a GPU (benchmarks/gpu_session.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import torchtitan_gpu as tg

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "torchtitan.md"


def _trainer_deps(api: str | None = "0.3"):
    """torchtitan's ConfigManager where its trainer imports, and it is ``api`` (None: any)."""
    try:
        from torchtitan.config import ConfigManager
        from torchtitan.models import llama3  # noqa: F401

        from galore2.integrations.torchtitan import API
    except ImportError as e:
        pytest.skip(f"torchtitan's trainer dependencies are not installed ({e})")
    if api is not None and API != api:
        pytest.skip(f"torchtitan {api}.x is not installed")
    return ConfigManager


def test_assets_are_what_the_debug_config_reads(tmp_path, monkeypatch):
    config_manager = _trainer_deps()
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    work = tg.prepare_assets(tmp_path)
    monkeypatch.chdir(work)  # torchtitan's debug config names paths relative to the cwd
    config = config_manager().parse_args(tg.train_args(10, 10, str(work / "dump")))
    tok = HuggingFaceTokenizer(tokenizer_path=config.hf_assets_path)
    assert tok.get_vocab_size() == tg.VOCAB <= 2048  # fits the debug model's embedding
    ids = tok.encode("def f(x): return x", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == "def f(x): return x"
    dataset = HuggingFaceTextDataset(config.dataloader.dataset, None, tok, seq_len=64)
    sample, label = next(iter(dataset))
    assert sample["input"].shape == label.shape == (64,)
    assert int(sample["input"].max()) < tg.VOCAB


def test_command_is_the_guides_debug_model_with_steps_and_a_checkpoint():
    config_manager = _trainer_deps(None)
    import galore2.integrations.torchtitan as tt

    assert f"--config {tg.CONFIG}" in GUIDE.read_text()  # the documented debug model
    cmd = tg.command(10, 10, "/tmp/dump")
    assert cmd[cmd.index("--nproc_per_node") + 1] == "1"
    config = config_manager().parse_args(cmd[cmd.index("torchtitan.train") + 1 :])
    assert (config.training.steps, config.checkpoint.enable, config.checkpoint.interval) == (
        10, True, 10
    )  # fmt: skip
    assert config.metrics.disable_color_printing
    if tt.API == "0.3":
        assert isinstance(config.optimizer, tt.GaLoreOptimizersContainer.Config)
        assert config.optimizer.param_groups[0].optimizer_name == "galore_adamw"
        assert config.dump_folder == "/tmp/dump"
        return
    # torchtitan 0.2.x: the same debug model and settings through its [optimizer] section
    from galore2.integrations.torchtitan.common import GALORE_DEBUG

    settings = tt.settings(config.optimizer)
    assert (config.model.name, config.model.flavor) == ("llama3_galore", "debugmodel")
    assert {k: settings.projected[k] for k in GALORE_DEBUG} == GALORE_DEBUG
    assert config.job.dump_folder == "/tmp/dump"


def _log(steps, losses, *extra):
    lines = list(extra) + [
        f"[rank0]:[titan] INFO - step: {s:2}  loss: {x:8.5f}  grad_norm:  1.0000  memory:  1.00GiB"
        for s, x in zip(steps, losses, strict=True)
    ]
    return "\n".join(lines)


def test_checks_pass_on_a_good_pair_of_runs_and_name_each_failure(tmp_path):
    (tmp_path / "checkpoint" / "step-6").mkdir(parents=True)
    first = _log(range(1, 7), [8.0, 7.5, 7.0, 6.8, 6.5, 6.4])
    second = _log(range(7, 10), [6.3, 6.2, 6.1], "Loading the checkpoint from x/step-6.",
                  "Training starts at step 7")  # fmt: skip
    assert tg.losses(first) == {1: 8.0, 2: 7.5, 3: 7.0, 4: 6.8, 5: 6.5, 6: 6.4}
    assert tg.check(first, second, 6, 9, tmp_path) == []
    flat = _log(range(1, 7), [8.0, 8.1, 8.0, 8.1, 8.0, 8.2])
    assert tg.check(flat, second, 6, 9, tmp_path) == [
        "run 1: loss did not fall (8.0000 at step 1, last 8.2000)"
    ]
    fresh = _log(range(1, 10), [8.0] * 9, "Training starts at step 1")
    bad = tg.check(first, fresh, 6, 9, tmp_path / "nowhere")
    assert bad[0].startswith("no checkpoint folder")
    assert bad[1:] == ["run 2 did not load a checkpoint", "run 2 did not start at step 7",
                       "run 2 logged steps [1, 2, 3, 4, 5, 6, 7, 8, 9], expected 7..9"]  # fmt: skip
