"""The pre-training recipe end to end: config, optimizers, schedule, runs, resume, plot."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes import optimizers
from recipes.config import CONFIG_DIR, OptimConfig
from recipes.metrics import read_metrics
from recipes.model import build_model, llama_config
from recipes.pretrain import main
from recipes.resolve import optim_config, parse_args

ROOT = Path(__file__).resolve().parents[2]

# A very small run: 2-layer dim-32 Llama, byte tokens, 64-token sequences.
SMALL = [
    "--config", "tiny",
    "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "2",
    "--model.ffn_dim", "64", "--model.max_seq_len", "64",
    "--data.seq_len", "64", "--train.batch_size", "4",
    "--optim.rank", "8", "--optim.update_proj_gap", "5",
    "--train.log_every", "2", "--train.eval_every", "4", "--train.eval_batches", "2",
    "--train.progress", "false", "--train.threads", "1",
]  # fmt: skip


def run(out: Path, *extra: str) -> list[dict]:
    return main([*SMALL, "--out", str(out), *extra])


def _galore(cfg: OptimConfig) -> tuple:
    """(rank, update_proj_gap, scale) in force for ``cfg`` (the values of galore2's options)."""
    return tuple(optimizers.setting(cfg, k) for k in ("rank", "update_proj_gap", "scale"))


def _without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` without the ``--flag VALUE`` pairs of ``flags``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


# --- configuration ------------------------------------------------------------------------


def test_cli_overrides_and_shorthands(tmp_path):
    job = parse_args(
        ["--config", "tiny", "--optimizer", "adamw", "--steps", "7", "--out", str(tmp_path),
         "--optim.lr=0.5", "--model.tie_embeddings", "true", "--optim.target_modules", "q_proj,v"]
    )  # fmt: skip
    assert job.optim.name == "adamw" and job.train.steps == 7 and job.train.out == str(tmp_path)
    assert job.optim.options["lr"] == 0.5 and job.model.tie_embeddings is True
    assert job.optim.target_modules == ["q_proj", "v"]
    assert job.model.dim == 128  # from tiny.toml, not the dataclass default (512)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--optim.nope", "1"], "unknown setting 'optim.nope'"),
        (["--bogus.lr", "1"], "unknown setting 'bogus.lr'"),
        (["--train.steps", "ten"], "train.steps must be int"),
        (["--train.resume", "maybe"], "train.resume must be bool"),
        (["--steps"], "--steps needs a value"),
        (["stray"], "unexpected argument"),
    ],
)
def test_cli_errors(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(argv)


def test_toml_typo_is_an_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nrnak = 4\n")
    with pytest.raises(ValueError, match=r"unknown setting 'optim.rnak'"):
        parse_args(["--config", str(bad)])
    with pytest.raises(FileNotFoundError, match="no recipe config"):
        parse_args(["--config", "no_such_config"])


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_builds(path):
    job = parse_args(["--config", str(path)])
    cfg = llama_config(job.model)
    model = build_model(job.model, "meta")
    n = sum(p.numel() for p in model.parameters())
    assert cfg.hidden_size == job.model.dim and n > 0
    if path.stem == "llama_7b":
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (4096, 32, 32)
        assert (cfg.intermediate_size, cfg.vocab_size, job.data.seq_len) == (11008, 32000, 2048)
        assert _galore(job.optim) == (1024, 500, 0.25)
        assert 6.6e9 < n < 6.8e9  # Llama-7B: 6.74B parameters
    if path.stem == "llama_20m":  # the benchmarks' scale check: tiny's data, r = dim / 4
        assert n == 19_242_496 and job.data.tokenizer == "byte" and job.data.dataset == "embedded"
        assert _galore(job.optim) == (128, 50, 0.25)


# --- optimizers and schedule -----------------------------------------------------------------


def test_optimizer_factory_names():
    model = build_model(parse_args(SMALL).model)
    for name in optimizers.NAMES:
        cfg = OptimConfig(name=name, options={"rank": 8})
        if optimizers.available(name):
            opt = optimizers.build_optimizer(model, cfg, 10)
            covered = [id(p) for g in opt.param_groups for p in g["params"]]
            assert sorted(covered) == sorted(id(p) for p in model.parameters())
            assert len(set(covered)) == len(covered)  # every parameter exactly once
        else:
            with pytest.raises(NotImplementedError, match="not available yet"):
                optimizers.build_optimizer(model, cfg, 10)
    with pytest.raises(ValueError, match=r"optim\.name must be one of"):
        optimizers.build_optimizer(model, OptimConfig(name="sgd"), 10)


def test_galore_groups_project_attention_and_mlp_only():
    model = build_model(parse_args(SMALL).model)
    opt = optimizers.build_optimizer(model, OptimConfig(name="galore_adamw", options={"rank": 8}), 10)
    names = {id(p): n for n, p in model.named_parameters()}
    projected = {names[id(p)] for g in opt.param_groups if g.get("rank") for p in g["params"]}
    assert projected and all(("self_attn" in n or "mlp" in n) for n in projected)
    assert all(n.endswith(".weight") for n in projected)
    no_decay = [
        names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]
    ]
    cfg = OptimConfig(name="galore_adamw", options={"weight_decay": 0.1, "rank": 8})
    opt = optimizers.build_optimizer(model, cfg, 10)
    no_decay = {
        names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]
    }
    assert no_decay == {n for n, p in model.named_parameters() if p.dim() < 2}


def test_schedule_hand_computed():
    cfg = OptimConfig(warmup_steps=10, min_lr_ratio=0.1)
    fn = optimizers.schedule_fn(cfg, 110)
    assert fn(0) == pytest.approx(0.1) and fn(9) == pytest.approx(1.0)
    assert fn(10) == pytest.approx(1.0)
    assert fn(60) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert fn(110) == pytest.approx(0.1) and fn(500) == pytest.approx(0.1)
    assert optimizers.schedule_fn(OptimConfig(warmup_ratio=0.1), 100)(4) == pytest.approx(0.5)


# --- runs ---------------------------------------------------------------------------------------


def assert_png(path: Path) -> None:
    """A whole PNG: signature, an image header with a size, the end chunk last."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 400 and height > 300, (width, height)
    assert data[-8:-4] == b"IEND", path


def test_tiny_run_writes_metrics_and_learns(tmp_path, capsys):
    hist = run(tmp_path, "--steps", "40", "--optim.lr", "0.01")
    recs = read_metrics(tmp_path)
    assert recs == hist and [r["step"] for r in recs] == list(range(2, 41, 2))
    for r in recs:
        assert {"step", "loss", "tokens_per_s", "lr", "tokens", "opt_state_bytes"} <= r.keys()
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and "peak_rss_gb" in r
    assert [r["step"] for r in recs if "val_loss" in r] == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    assert recs[-1]["tokens"] == 40 * 4 * 64
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0  # from ~ln(257) = 5.5 down
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["opt_state_bytes"] < summary["adamw_state_bytes"]
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["options"]["rank"] == 8
    assert_png(tmp_path / "loss.png")  # the run's own curves, named in its summary
    assert f"loss curves        {tmp_path / 'loss.png'}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--optim.per_layer", "true"],
        ["--optimizer", "adamw"],
        ["--model.weight_bits", "8", "--optim.per_layer", "true"],  # int8 weights (issue 40)
    ],
)
def test_stop_and_resume_matches_uninterrupted(tmp_path, extra):
    whole = run(tmp_path / "whole", "--steps", "12", *extra)
    first = run(tmp_path / "split", "--steps", "12", "--train.stop_after", "6", *extra)
    assert [r["step"] for r in first] == [2, 4, 6]
    resumed = run(tmp_path / "split", "--steps", "12", *extra)
    assert [r["step"] for r in resumed] == [8, 10, 12]
    full = {r["step"]: r for r in whole}
    for r in resumed:
        assert r["loss"] == full[r["step"]]["loss"], r["step"]
        assert r.get("val_loss") == full[r["step"]].get("val_loss")
        assert r["tokens"] == full[r["step"]]["tokens"]
    assert [r["step"] for r in read_metrics(tmp_path / "split")] == [2, 4, 6, 8, 10, 12]


def test_per_layer_refuses_clipping(tmp_path):
    with pytest.raises(ValueError, match="max_grad_norm"):
        run(tmp_path, "--optim.per_layer", "true", "--optim.max_grad_norm", "1.0")


def test_plot_writes_png(tmp_path):
    run(tmp_path / "a", "--steps", "4")
    run(tmp_path / "b", "--steps", "4", "--optimizer", "adamw")
    from recipes.plot import main as plot_main

    png = plot_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c.png")])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    with pytest.raises(FileNotFoundError, match=r"no metrics\.jsonl"):
        plot_main([str(tmp_path / "missing"), "--out", str(tmp_path / "d.png")])
    from recipes.plot import plot

    with pytest.raises(ValueError, match="names must name each of the 1 runs, got 2"):
        plot([tmp_path / "a"], tmp_path / "e.png", names=["x", "y"])


def test_run_plot_without_matplotlib_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from recipes.plot import write_run_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # its import raises ImportError
    job = parse_args([*SMALL, "--out", str(tmp_path)])
    assert write_run_plot(job, 1000) is None and not (tmp_path / "loss.png").exists()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["loss.png not written: matplotlib is not installed (pip install matplotlib)"]


def test_the_process_group_goes_after_the_model_and_optimizer(tmp_path, monkeypatch):
    """A rank that destroys its process group while FSDP state still holds it dies now and
    then at exit (SIGABRT): by teardown, nothing of the run's model or optimizer is alive."""
    import gc
    import weakref

    from recipes import pretrain

    built: list[weakref.ref] = []
    real_model, real_opt = pretrain.modeling.build_model, pretrain.optimizers.build_optimizer

    def model(*args, **kwargs):
        built.append(weakref.ref(m := real_model(*args, **kwargs)))
        return m

    def optimizer(*args, **kwargs):
        built.append(weakref.ref(o := real_opt(*args, **kwargs)))
        return o

    alive: list[bool] = []

    def teardown(world: int) -> None:
        gc.collect()
        alive.extend(ref() is not None for ref in built)

    monkeypatch.setattr(pretrain.modeling, "build_model", model)
    monkeypatch.setattr(pretrain.optimizers, "build_optimizer", optimizer)
    monkeypatch.setattr(pretrain, "teardown", teardown)
    run(tmp_path, "--steps", "2")
    assert alive == [False, False]


def _torchrun(out: Path, steps: int, *extra: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), "-m", "recipes.pretrain", *SMALL, "--steps", str(steps),
           "--out", str(out), *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_torchrun_fsdp2_resume_matches_uninterrupted(tmp_path):
    """Two ranks with FSDP2 under torchrun (gloo): stop at 4, resume to 8, same curve."""
    done = _torchrun(tmp_path / "whole", 8)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_png(tmp_path / "whole" / "loss.png")
    assert done.stdout.count("loss curves") == 1  # rank 0's summary only
    for stop in ("4", "0"):
        done = _torchrun(tmp_path / "split", 8, "--train.stop_after", stop)
        assert done.returncode == 0, done.stderr[-3000:]
    whole, split = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in split] == [r["step"] for r in whole] == [2, 4, 6, 8]
    for a, b in zip(whole, split, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-6)
        assert a["tokens"] == b["tokens"] == a["step"] * 2 * 4 * 64
    # the sharded run learns the same thing as one process on the same global batch
    single = main(
        [*SMALL, "--steps", "8", "--train.batch_size", "8", "--out", str(tmp_path / "one")]
    )
    assert whole[-1]["loss"] == pytest.approx(single[-1]["loss"], rel=2e-3)
    assert torch.distributed.is_initialized() is False


def test_activation_checkpointing_gives_the_same_run(tmp_path):
    plain = run(tmp_path / "plain", "--steps", "6")
    ckpt = run(tmp_path / "ac", "--steps", "6", "--model.activation_checkpointing", "true")
    for a, b in zip(plain, ckpt, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


@pytest.mark.slow
def test_compiled_layers_train_like_eager(tmp_path):
    eager = run(tmp_path / "eager", "--steps", "6")
    compiled = run(tmp_path / "compiled", "--steps", "6", "--model.compile", "true")
    for a, b in zip(eager, compiled, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)


@pytest.mark.parametrize("name", ["ranger21", "galore_ranger21"])
def test_recipe_runs_ranger21_presets(tmp_path, name):
    hist = run(tmp_path, "--steps", "8", "--optimizer", name, "--optim.lr", "0.01")
    assert all(math.isfinite(r["loss"]) for r in hist)
    assert hist[-1]["loss"] < hist[0]["loss"]
    lrs = [r["lr"] for r in hist]
    assert lrs == [0.01] * len(lrs)  # the recipe's schedule stays flat: Ranger21 has its own


LOW_RANK_RUNS = {
    "fira": ["--optimizer", "fira"],
    "apollo": ["--optimizer", "apollo"],
    "apollo_mini": ["--optimizer", "apollo_mini"],
    "galore_muon": ["--optimizer", "galore_muon"],
    "galore_adamw+fira": ["--optimizer", "galore_adamw", "--optim.residual", "fira"],
}


@pytest.mark.parametrize("extra", LOW_RANK_RUNS.values(), ids=LOW_RANK_RUNS.keys())
def test_recipe_runs_low_rank_presets(tmp_path, capsys, extra):
    fixed = optimizers.preset_fields(extra[1])  # given on the command line they are refused
    base = _without(SMALL, *(f"--optim.{k}" for k in fixed))
    hist = main([*base, "--out", str(tmp_path), "--steps", "4", "--optim.lr", "0.01", *extra])
    assert [r["step"] for r in hist] == [2, 4]
    assert all(math.isfinite(r["loss"]) for r in hist) and math.isfinite(hist[-1]["val_loss"])
    config = json.loads((tmp_path / "config.json").read_text())["optim"]
    fixed = optimizers.preset_fields(config["name"])
    assert config["fixed"] == fixed and {k: config["options"][k] for k in fixed} == fixed
    assert (f"{config['name']}: optim." in capsys.readouterr().out) == bool(fixed)


def test_apollo_mini_projects_at_rank_1_and_apollo_at_its_alpha():
    """APOLLO-Mini is rank 1 by definition (APOLLOMini.projected_rank), whatever optim.rank
    says; APOLLO's and APOLLO-Mini's α are their own (preset_defaults), not optim.scale."""
    model = build_model(parse_args(SMALL).model)
    assert optimizers.preset_fields("apollo_mini") == {"scale": math.sqrt(128), "rank": 1}
    assert optimizers.preset_fields("apollo") == {"scale": 1.0}
    assert optimizers.preset_fields("fira") == optimizers.preset_fields("galore_adamw") == {}
    for name, rank, scale in (("apollo_mini", 1, math.sqrt(128)), ("apollo", 8, 1.0)):
        cfg = optim_config({"name": name, "rank": 8, "scale": 0.25})  # as a config file sets them
        opt = optimizers.build_optimizer(model, cfg, 10)
        (group,) = [g for g in opt.param_groups if g["rank"] is not None]
        assert (group["rank"], group["scale"]) == (rank, scale)
        assert group["projector"] == "random" and group["scale_type"] is not None
        opt.init_state()
        moments = [opt.state[p]["adam.exp_avg"].shape for p in group["params"]]
        assert all(rank in shape for shape in moments), moments
    job = parse_args([*_without(SMALL, "--optim.rank"), "--optimizer", "apollo_mini"])
    assert _galore(job.optim)[::2] == (1, math.sqrt(128))  # the configuration in force
    job = parse_args([*SMALL, "--optimizer", "galore_adamw"])
    assert _galore(job.optim)[::2] == (8, 0.25)  # SMALL's, untouched


def test_galore_options_apply_to_every_projecting_optimizer():
    """``--optim.residual fira`` (a GaLore option) reaches the projected group of every
    galore2 optimizer with GaLore in its chain, and only that group; an optimizer without
    GaLore refuses it."""
    model = build_model(parse_args(SMALL).model)
    names = [n for n in optimizers.PRESETS if optimizers.projects(n)]
    assert "ranger21" not in names and {"fira", "apollo", "apollo_mini", "galore_muon"} <= {*names}
    for name in names:
        if "scale_type" in optimizers.PRESETS[name].preset_defaults:
            continue  # APOLLO's scaling and Fira's residual are alternatives (refused together)
        cfg = OptimConfig(name=name, options={"rank": 8, "residual": "fira"})
        opt = optimizers.build_optimizer(model, cfg, 10)
        kinds = {g["rank"] is not None: g["residual"] for g in opt.param_groups}
        assert kinds[True] == "fira", name
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters()), name
    with pytest.raises(
        ValueError, match=r"unknown setting 'optim.residual' for optimizer ranger21"
    ):
        parse_args([*SMALL, "--optimizer", "ranger21", "--optim.residual", "fira"])


def test_a_field_the_preset_fixes_is_refused_on_the_command_line():
    """APOLLO-Mini is rank 1 with α = √128 by definition: --optim.rank / --optim.scale would be
    ignored, so they are an error naming the field (the config file's values are replaced)."""
    from recipes.resolve import optim_config, parse_args

    assert parse_args(["--config", "tiny", "--optimizer", "apollo_mini"]).optim.options["rank"] == 1
    for flag, value in (("--optim.rank", "4"), ("--optim.scale", "2")):
        with pytest.raises(ValueError, match=flag):
            parse_args(["--config", "tiny", "--optimizer", "apollo_mini", flag, value])
