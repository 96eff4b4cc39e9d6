"""The recipe says when something is wrong (issue 16): divergence, missing evaluation,
resumed logs, bad settings and bad data, and errors on the command line."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from recipes.config import JobConfig
from recipes.metrics import Metrics, read_metrics
from recipes.resolve import parse_args
from recipes.summary import summarize

from .test_data import BYTE, cfg, make_docs, offline  # noqa: F401  (offline: a fixture)
from .test_recipe import ROOT, _torchrun, run

# the small model collapses at once, and from step ~11 skips about half its updates
DIVERGING = ["--optim.lr", "1e4", "--optim.scale", "100"]


def raw_steps(out) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


# --- item 5: divergence -------------------------------------------------------------------


def test_divergence_stops_loudly_and_keeps_metrics_and_summary(tmp_path, capsys):
    from recipes.divergence import Diverged

    with (
        pytest.warns(RuntimeWarning, match="parameter updates skipped"),
        pytest.raises(Diverged, match=r"diverged at step \d+.*optim\.lr=10000.*optim\.scale=100"),
    ):
        run(tmp_path, "--steps", "20", *DIVERGING, "--train.max_skip_steps", "3")
    recs = read_metrics(tmp_path)
    assert recs and recs[-1]["step"] < 20  # stopped early, and logged the step it stopped at
    assert recs[-1]["nonfinite_skips"] > 0
    assert sum(r["nonfinite_skips_window"] for r in recs) == recs[-1]["nonfinite_skips"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["nonfinite_skips"] == recs[-1]["nonfinite_skips"]
    assert summary["step"] == recs[-1]["step"] and "diverged" in summary["stopped"]
    out = capsys.readouterr().out
    assert "skipped updates" in out and "stopped early" in out


def test_skips_are_counted_when_the_stop_is_off(tmp_path):
    with pytest.warns(RuntimeWarning, match="non-finite"):
        hist = run(tmp_path, "--steps", "14", *DIVERGING, "--train.max_skip_steps", "0")
    assert [r["step"] for r in hist] == list(range(2, 15, 2))
    totals = [r["nonfinite_skips"] for r in hist]
    assert totals == sorted(totals) and totals[-1] > 0
    assert sum(r["nonfinite_skips_window"] for r in hist) == totals[-1]
    assert json.loads((tmp_path / "summary.json").read_text())["nonfinite_skips"] == totals[-1]
    assert JobConfig().train.max_skip_steps == 10  # on by default


def test_torchrun_ranks_stop_together(tmp_path):
    """Two FSDP2 ranks (gloo) stop at the same step with one clear line each; no hang."""
    done = _torchrun(tmp_path, 20, *DIVERGING, "--train.max_skip_steps", "2")
    assert done.returncode != 0
    # both ranks' stderr share one pipe, so lines may interleave: search, not split
    found = re.findall(r"error \(rank (\d)\): training diverged at step (\d+)", done.stderr)
    assert sorted(r for r, _ in found) == ["0", "1"], done.stderr[-3000:]
    assert len({s for _, s in found}) == 1  # the same step on both ranks
    assert read_metrics(tmp_path)[-1]["nonfinite_skips"] > 0


def test_a_healthy_run_logs_zero_skips(tmp_path):
    hist = run(tmp_path, "--steps", "4")
    assert [r["nonfinite_skips"] for r in hist] == [0, 0]


def test_nonfinite_loss_is_logged_as_such_and_warned(tmp_path):
    m = Metrics(tmp_path, rank=0, total_steps=4, start_step=0, flops_per_token=1.0,
                device=torch.device("cpu"), progress=False)  # fmt: skip
    m.add(torch.tensor(float("nan")), 10)
    m.add(torch.tensor(2.0), 10)
    with pytest.warns(RuntimeWarning, match="loss was not finite"):
        rec = m.log(2, 0.1)
    assert math.isnan(rec["loss"]) and rec["nonfinite_losses"] == 1
    assert "NaN" in (tmp_path / "metrics.jsonl").read_text()
    m.add(torch.tensor(1.0), 10)
    assert "nonfinite_losses" not in m.log(3, 0.1)


# --- item 7: no evaluation is no val loss --------------------------------------------------


def test_eval_batches_zero_reports_no_val_loss(tmp_path, capsys):
    hist = run(tmp_path, "--steps", "4", "--train.eval_batches", "0")
    assert hist and not any("val_loss" in r for r in read_metrics(tmp_path))
    assert json.loads((tmp_path / "summary.json").read_text())["val_loss"] is None
    assert "final val loss     n/a" in capsys.readouterr().out
    from recipes.plot import main as plot_main

    png = plot_main([str(tmp_path), "--out", str(tmp_path / "p.png")])
    assert png.read_bytes()[:4] == b"\x89PNG"


# --- item 9: a resumed run logs each step once -------------------------------------------------


def test_resume_drops_rows_logged_after_the_checkpoint(tmp_path):
    run(tmp_path, "--steps", "12", "--train.stop_after", "8")  # checkpoint at step 8
    path = tmp_path / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    ghost = {**rows[-1], "step": 10, "loss": 99.0}  # logged, then killed before a checkpoint
    path.write_text(path.read_text() + json.dumps(ghost) + "\n")
    run(tmp_path, "--steps", "12")  # resumes at 8
    steps = raw_steps(tmp_path)
    assert steps == [2, 4, 6, 8, 10, 12]  # strictly increasing, each once
    assert 99.0 not in [r["loss"] for r in read_metrics(tmp_path)]


def test_readers_keep_the_last_row_of_a_step(tmp_path):
    rows = [{"step": s, "loss": float(s), "tokens": s, "tokens_per_s": 1.0} for s in (2, 4, 6)]
    rows += [{"step": 4, "loss": 40.0, "tokens": 4, "tokens_per_s": 1.0, "val_loss": 3.0}]
    rows += [{"step": 6, "loss": 60.0, "tokens": 6, "tokens_per_s": 1.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = [(2, 2.0), (4, 40.0), (6, 60.0)]
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == expected
    path.write_text(path.read_text() + '{"step": 8, "lo')  # a run killed mid-write
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == expected
    s = summarize(rows, None, 1)
    assert (s["step"], s["train_loss"], s["val_loss"]) == (6, 60.0, 3.0)
    from recipes.plot import plot

    assert plot([tmp_path], tmp_path / "p.png", x="step").is_file()


# --- item 16: settings, data and the command line -------------------------------------------


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--train.log_every", "0"], r"train\.log_every must be >= 1, got 0"),
        (["--train.eval_every", "0"], r"train\.eval_every must be >= 1, got 0.*eval_batches 0"),
        (["--train.eval_batches", "-1"], r"train\.eval_batches must be >= 0"),
        (["--train.max_skip_steps", "-1"], r"train\.max_skip_steps must be >= 0"),
    ],
)
def test_intervals_are_checked_when_parsed(argv, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        parse_args(argv)
    key, value = argv[0][2:].split(".")[1], argv[1]
    toml = tmp_path / "bad.toml"
    toml.write_text(f"[train]\n{key} = {value}\n")
    with pytest.raises(ValueError, match=match):  # the same check for a TOML config
        parse_args(["--config", str(toml)])


def _jsonl(tmp_path, lines: list[str]) -> str:
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_malformed_jsonl_names_the_file_and_line(tmp_path, offline):  # noqa: F811
    from recipes.data import build_loaders

    good = [json.dumps({"text": d}) for d in make_docs(40)]
    path = _jsonl(tmp_path, [*good[:6], '{"text": "cut off', *good[6:]])
    with pytest.raises(ValueError, match=r"corpus\.jsonl:7: malformed JSON"):
        build_loaders(cfg(dataset=path), BYTE, 2, cache_dir=offline)


def test_jsonl_rows_without_the_text_field_are_an_error(tmp_path, offline):  # noqa: F811
    from recipes.data import build_loaders

    good = [json.dumps({"text": d}) for d in make_docs(40)]
    path = _jsonl(tmp_path, [*good[:4], '{"body": "x"}', *good[4:], '{"text": null}'])
    with pytest.raises(ValueError, match=r"corpus\.jsonl:5: .*no data\.text_field='text'.*2 of 42"):
        build_loaders(cfg(dataset=path), BYTE, 2, cache_dir=offline)


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "GALORE2_DEBUG"}
    env = {**base, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **env}
    cmd = [sys.executable, "-m", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_cli_user_errors_print_one_line_and_exit_2(tmp_path, monkeypatch):
    """``python -m recipes.pretrain`` / ``recipes.plot`` in a fresh process: one line, exit 2.
    The traceback on request is run_cli's own (what both ``__main__`` blocks call), here in
    this process: the error is raised, not reported (a process then prints it and exits 1)."""
    done = _cli("recipes.pretrain", "--config", "tiny", "--train.log_every", "0")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "error: train.log_every must be >= 1, got 0"
    done = _cli("recipes.plot", str(tmp_path / "missing"))
    assert (
        done.returncode == 2
        and done.stderr.startswith("error: ")
        and "Traceback" not in done.stderr
    )
    from recipes import plot, pretrain
    from recipes.cli import run_cli

    monkeypatch.delenv("GALORE2_DEBUG", raising=False)
    with pytest.raises(ValueError, match=r"train\.log_every must be >= 1, got 0"):
        run_cli(pretrain.main, ["--train.log_every", "0", "--debug"])  # --debug taken out
    monkeypatch.setenv("GALORE2_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        run_cli(plot.main, [str(tmp_path / "missing")])


def test_run_cli_reports_and_programmatic_main_raises(capsys):
    from recipes.cli import run_cli
    from recipes.divergence import Diverged

    def bad(argv):
        raise ValueError(f"bad {argv}")

    with pytest.raises(SystemExit) as e:
        run_cli(bad, ["--x", "1"])
    assert e.value.code == 2 and capsys.readouterr().err == "error: bad ['--x', '1']\n"

    def diverges(argv):
        raise Diverged("training diverged at step 3")

    with pytest.raises(SystemExit) as e:
        run_cli(diverges, [])
    assert e.value.code == 1 and "error: training diverged" in capsys.readouterr().err
    with pytest.raises(ValueError, match="bad"):
        run_cli(bad, ["--debug"])
    with pytest.raises(RuntimeError, match="not a user error"):  # a bug keeps its traceback
        run_cli(lambda argv: (_ for _ in ()).throw(RuntimeError("not a user error")), [])
    with pytest.raises(ValueError, match=r"train\.log_every"):
        from recipes.pretrain import main

        main(["--train.log_every", "0"])
