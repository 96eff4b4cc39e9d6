"""The benchmark runner (benchmarks/run.py) and its side-by-side suite: registry, peers,
storage rules (benchmarks/state.py), tasks, output."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import pytest
import torch

from benchmarks import convergence, footprint, llama_7b, run, scale_check, suite
from benchmarks.contenders import BY_KEY, CONTENDERS, why_not
from benchmarks.peers import PEERS
from benchmarks.state import RULES, counted, nbytes, optimizer_state
from recipes import optimizers
from recipes.config import ModelConfig, OptimConfig
from recipes.metrics import optimizer_state_bytes
from recipes.model import build_model
from recipes.optimizers import build_optimizer

SMALL = ModelConfig(vocab_size=300, dim=64, n_layers=1, n_heads=2, ffn_dim=160, max_seq_len=16)
CUDA_ONLY = ("gt_galore_adamw8bit", "qgalore")


def _stepped(key: str, rank: int = 8, steps: int = 2):
    torch.manual_seed(0)
    model = build_model(SMALL)
    opt = build_optimizer(model, BY_KEY[key].optim_config(rank=rank), 10, PEERS)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return model, opt


def test_every_peer_covers_every_parameter_once():
    """Each peer the benchmarks give the recipe is built on the recipe's split: every
    parameter in exactly one group; a missing package is a clear RuntimeError."""
    model = build_model(SMALL)
    for name, peer in PEERS.items():
        if not optimizers.available(name, PEERS):
            with pytest.raises(RuntimeError, match=f"needs {peer.package}"):
                peer.load()
            continue
        opt = build_optimizer(model, OptimConfig(name=name, options={"rank": 8}), 10, PEERS)
        covered = [id(p) for g in opt.param_groups for p in g["params"]]
        assert sorted(covered) == sorted(id(p) for p in model.parameters()), name
        assert len(set(covered)) == len(covered), name
        assert optimizers.projects(name, PEERS) == peer.projected
    with pytest.raises(ValueError, match=r"optim\.name must be one of .*benchmarks\.pretrain"):
        build_optimizer(model, OptimConfig(name="gt_galore_adamw"), 10)  # not without PEERS


@pytest.mark.parametrize("key", [c.key for c in CONTENDERS if c.optimizer in RULES])
def test_storage_rule_equals_the_peers_real_state(key):
    """The 7B table's peer rows come from these rules: they must equal what the package holds."""
    model, opt = _stepped(key)
    projected = [p for g in opt.param_groups if "rank" in g for p in g["params"]]
    assert bool(projected) == BY_KEY[key].projected
    measured = optimizer_state_bytes(opt)
    assert measured == nbytes(counted(BY_KEY[key].optimizer, model, projected, 8))
    # the calculator finds the same projected group from the recipe config
    assert measured == optimizer_state(model, BY_KEY[key].optim_config(rank=8))["total"]


def test_shared_storage_is_counted_once():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = torch.optim.SGD([p], lr=0.1)
    shared = torch.zeros(64)
    opt.state[p] = {"a": shared, "b": shared[:8], "c": torch.zeros(3, dtype=torch.float64)}
    assert optimizer_state_bytes(opt) == 64 * 4 + 3 * 8


def test_every_contender_runs_here_or_says_exactly_why():
    for c in CONTENDERS:
        reason = why_not(c.key)
        if c.package in ("galore2", "torch", "bitsandbytes") or c.key not in CUDA_ONLY:
            assert reason is None, (c.key, reason)
        elif not torch.cuda.is_available():
            assert reason and "raised at" in reason, (c.key, reason)


def test_galore_torch_8bit_reason_names_the_cuda_call():
    if torch.cuda.is_available():
        pytest.skip("the reason only exists without CUDA")
    reason = why_not("gt_galore_adamw8bit")
    assert "CUDA" in reason and "galore_torch/adamw8bit.py" in reason


def test_state_7b_galore2_rows_are_its_own_count_and_peers_follow_rules():
    """Quick shapes (llama_60m on meta): AdamW 8 B/param; 8-bit + INT4 basis well below GaLore."""
    chosen = [BY_KEY[k] for k in ("adamw", "gt_galore_adamw", "galore_adamw",
                                  "galore_adamw8bit_int4", "qgalore")]  # fmt: skip
    sizes = llama_7b.state_by_contender(chosen, quick=True)
    job, _ = llama_7b.shapes(True)
    model = build_model(job.model, device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert sizes["adamw"] == 8 * n + 4 * len(list(model.parameters()))
    assert sizes["qgalore"] is None  # no verified rule: not run here
    assert sizes["galore_adamw8bit_int4"] < 0.5 * sizes["galore_adamw"] < sizes["adamw"]
    assert sizes["gt_galore_adamw"] > sizes["galore_adamw"]  # it keeps the whole SVD factor


def test_footprint_worker_reports_state_time_and_refresh(monkeypatch):
    small = {"vocab_size": 300, "dim": 64, "n_layers": 1, "n_heads": 2, "ffn_dim": 160}
    monkeypatch.setitem(footprint.SIZES, "quick", small)
    monkeypatch.setitem(footprint.RANK, "quick", 8)
    got = footprint.measure(BY_KEY["galore_adamw"], quick=True)
    _, opt = _stepped("galore_adamw")
    assert got["state_bytes"] == opt.state_bytes()["total"]
    assert got["step_ms"] > 0 and got["refresh_ms"] is not None
    plain = footprint.measure(BY_KEY["adamw"], quick=True)
    assert plain["refresh_ms"] is None and plain["state_bytes"] > got["state_bytes"]


def test_convergence_sweep_extends_at_a_winning_edge(monkeypatch, tmp_path):
    seen = []

    def fake(contender, lr, out, steps):
        seen.append(lr)
        return {"lr": lr, "best": abs(lr - 0.05)}  # best lr is beyond the grid's top

    monkeypatch.setattr(convergence, "run_one", fake)
    runs = convergence.sweep(BY_KEY["adamw"], str(tmp_path), quick=False)
    assert seen == [*convergence.GRID, 3e-2]
    assert [r["lr"] for r in runs] == sorted(seen)


def test_convergence_resume_keeps_saved_sweeps_and_reports_each_new_one(monkeypatch):
    swept, reported = [], []

    def fake(contender, tmp, quick):
        swept.append(contender.key)
        return [{"lr": 1e-3, "best": float(len(swept))}]

    monkeypatch.setattr(convergence, "sweep", fake)
    saved = {"adamw": [{"lr": 3e-3, "best": 9.0}]}
    keys = ("adamw", "gt_galore_adamw", "galore_adamw")
    got = convergence.run(
        [BY_KEY[k] for k in keys], False, saved, lambda r: reported.append(dict(r))
    )
    assert swept == ["gt_galore_adamw", "galore_adamw"]  # the saved sweep is not rerun
    assert list(got) == list(keys) and got["adamw"] == saved["adamw"]
    assert [list(r) for r in reported] == [list(keys[:2]), list(keys)]


def test_convergence_table_flags_a_sweep_that_spans_machines():
    def result(lr, cpu):
        return {"lr": lr, "best": 1.0 + lr, "tokens_per_s": 1e3, "state_bytes": 10,
                "curve": [(1, 2.0)], "tokens": 100, "cpu": cpu}  # fmt: skip

    labels = {c.key: c.label for c in CONTENDERS}
    same = {"adamw": [result(1e-3, "A")], "galore_adamw": [result(1e-2, "A")]}
    assert "more than one machine" not in suite.convergence_md(same, labels, quick=False)
    mixed = {"adamw": [result(1e-3, "A")], "galore_adamw": [result(1e-2, "B")]}
    text = suite.convergence_md(mixed, labels, quick=False)
    assert "more than one machine" in text and "`B`: galore2 GaLoreAdamW" in text


def test_suite_end_to_end_writes_sections_and_plots(monkeypatch, tmp_path):
    """A cut-down ``python -m benchmarks.run --quick``: 4 steps, three contenders; the
    footprint worker runs in this process on the small model (its fresh-process form:
    test_footprint_subprocess_returns_json; galore-torch's refreshes at the quick size took
    most of this test's two minutes)."""
    monkeypatch.setattr(convergence, "QUICK_STEPS", 4)
    small = {"vocab_size": 300, "dim": 64, "n_layers": 1, "n_heads": 2, "ffn_dim": 160}
    monkeypatch.setitem(footprint.SIZES, "quick", small)
    monkeypatch.setitem(footprint.RANK, "quick", 8)
    measured = []

    def in_process(key, quick):
        measured.append((key, quick))
        return footprint.measure(BY_KEY[key], quick)

    monkeypatch.setattr(footprint, "in_subprocess", in_process)
    out = tmp_path / "B.md"
    keys = "adamw,gt_galore_adamw,galore_adamw"
    run.main(["--quick", "--optimizers", keys, "--out", str(out)])
    text = out.read_text()
    for task in (*run.DEFAULT, "targets"):
        assert f"<!-- BEGIN galore2-bench:suite_{task} -->" in text
    assert "Command: `python -m benchmarks.run --quick --optimizers" in text
    assert "galore-torch GaLoreAdamW" in text and "refresh ≥ 8× faster" in text
    assert measured == [(k, True) for k in keys.split(",")]  # every contender's footprint
    for png in ("convergence.png", "memory_7b.png"):
        data = (tmp_path / "figures" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_footprint_subprocess_returns_json():
    got = footprint.in_subprocess("adamw", quick=True)
    assert json.loads(json.dumps(got))["state_bytes"] > 0
    assert got["peak_rss_delta"] is None or got["peak_rss_delta"] >= 0


def test_bad_task_and_optimizer_names_are_refused(capsys):
    with pytest.raises(SystemExit):
        run.main(["--tasks", "refresh,speedy"])
    err = capsys.readouterr().err
    assert "--tasks: unknown task 'speedy'; choose from: peers, " in err and "low_memory" in err
    with pytest.raises(SystemExit):
        run.main(["--optimizers", "sgd"])
    assert "--optimizers: unknown ['sgd']" in capsys.readouterr().err


def test_registry_lists_every_task_and_resolves_each():
    """One registry: the suite, every former run_core benchmark, kernels and the Adafactor probe."""
    expected = {"peers", "state_7b", "footprint", "convergence", "targets", "per_byte", "refresh",
                "step_time", "step_counts", "memory_7b", "traffic_7b", "recipe_tiny",
                "recipe_memory_7b", "throughput", "ranger21", "basis_quant", "low_memory", "kernels",
                "gpu_step", "refresh_schedule", "proj_precision", "overhead", "gpu_host",
                "gpu_throughput", "adafactor_step", "compile_step", "scale_check", "build_memory", "fit_24gb",
                "fit_16gb", "roofline", "int8_weights"}  # fmt: skip
    assert set(run.TASKS) == expected
    assert set(run.DEFAULT) == {"peers", "state_7b", "footprint", "convergence"}
    opt_in = ("scale_check", "fit_24gb", "fit_16gb")
    assert run.parse_tasks("all") == [n for n in run.TASKS if n not in opt_in]
    assert all(n not in tasks for tasks in run.GROUPS.values() for n in opt_in)
    assert run.parse_tasks("scale_check") == ["scale_check"]
    assert run.parse_tasks("step_time,refresh") == ["refresh", "step_time"]  # registry order
    with pytest.raises(ValueError, match="unknown tasks 'a', 'b'"):
        run.parse_tasks("a,refresh,b")
    listing = run.listing()
    for name, task in run.TASKS.items():
        fn = getattr(importlib.import_module(f"benchmarks.{task.module}"), task.function)
        params = set(inspect.signature(fn).parameters)
        assert params <= {"quick", "suite", "repeats", "rounds", "warmup", "json_path",
                          "steps", "config", "card_gib", "processes", "jobs"}, name  # fmt: skip
        assert name in listing and task.title in listing
    assert "needs CUDA" in listing.splitlines()[list(run.TASKS).index("kernels")]
    for name in opt_in:
        assert "opt-in" in listing.splitlines()[list(run.TASKS).index(name)]


def test_gpu_task_without_cuda_says_it_needs_cuda(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "B.md"
    assert run.main(["--tasks", "kernels", "--out", str(out)]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out
    assert not out.exists()


def test_meta_device_task_writes_its_section(tmp_path):
    """``--tasks memory_7b`` (meta-device arithmetic, seconds): a section with the 7B figures."""
    out = tmp_path / "B.md"
    run.main(["--tasks", "memory_7b", "--out", str(out)])
    text = out.read_text()
    assert text.startswith("# galore2 benchmarks\n")
    assert "<!-- BEGIN galore2-bench:memory_7b -->\n## Optimizer-state memory, Llama-7B" in text
    assert "Command: `python -m benchmarks.run --tasks memory_7b --out" in text
    assert (
        "| galore2 GaLoreAdamW, r=1024 | 15.051 | 3.758 | 14,152 | 18.809 | 17.52 | 0.349 |" in text
    )
    run.main(["--tasks", "memory_7b", "--out", str(out), "--no-write"])  # unchanged
    assert out.read_text() == text


def test_step_targets_compare_with_galore_torchs_class_for_the_same_algorithm():
    """Adafactor is judged against galore-torch's GaLoreAdafactor; 8-bit against its
    GaLoreAdamW, since galore-torch's 8-bit class has no CPU figures (None)."""
    from benchmarks.suite_targets import targets_md

    foot = {
        "adamw": {"step_ms": 100.0, "refresh_ms": None},
        "gt_galore_adamw": {"step_ms": 200.0, "refresh_ms": 1000.0},
        "gt_galore_adafactor": {"step_ms": 400.0, "refresh_ms": 1000.0},
        "gt_galore_adamw8bit": None,
        "galore_adafactor": {"step_ms": 300.0, "refresh_ms": 100.0},
        "galore_adamw8bit": {"step_ms": 300.0, "refresh_ms": 100.0},
    }
    conv = {"gt_galore_adafactor": [{"best": 1.5}], "galore_adafactor": [{"best": 1.4}]}
    labels = {c.key: c.label for c in CONTENDERS}
    md = targets_md({"convergence": conv, "footprint": foot, "state_7b": {}}, labels)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines()}
    adafactor = rows["galore2 GaLoreAdafactor: step never slower than galore-torch's "
                     "(galore-torch GaLoreAdafactor)"]  # fmt: skip
    assert "0.75×" in adafactor and "**met**" in adafactor
    eight = rows["galore2 GaLoreAdamW8bit: step never slower than galore-torch's "
                 "(galore-torch GaLoreAdamW)"]  # fmt: skip
    assert "1.50×" in eight and "**missed**" in eight
    loss = rows["GaLoreAdafactor best val loss ≤ galore-torch GaLoreAdafactor's"]
    assert "0.933×" in loss and "**met**" in loss


# Llama-7B state bytes as published in BENCHMARKS.md (suite_state_7b, low_memory, memory_7b),
# recorded before the calculators were merged into recipes/state.py (now benchmarks/state.py).
PUBLISHED_7B = {
    "adamw": 53907326092, "bnb_adamw8bit": 13687408768, "gt_galore_adamw": 30083678208,
    "gt_galore_adamw8bit": None, "gt_galore_adafactor": 15040982156, "qgalore": None,
    "apollo": 18809389952, "apollo_mini": 2115601280, "pto_galore": 18809389056,
    "pto_ranger21": 134768312320, "galore_adamw": 18809403208,
    "galore_adamw_power": 18809403208, "galore_adamw8bit": 7581318744,
    "galore_adamw8bit_int8": 4777426520, "galore_adamw8bit_int4": 4307664472,
    "galore_adafactor": 3766710648, "galore_adafactor_int8": 962818424,
    "ranger21": 107814659168, "galore_ranger21": 53288716664,
    # contenders added after that publication (fira; galore2's Fira, APOLLO, GaLoreMuon):
    # fira keeps galore-torch's whole-SVD-factor basis plus one norm per projected matrix
    "fira_adamw": 30083679104, "galore2_fira": 18809405000, "galore2_fira_power": 18809405000,
    "galore2_fira_reference": 18809405000,
    "galore2_fira_8bit_int8": 4777428312, "galore2_apollo": 15051310408,
    "galore2_apollo_mini": 2111948104, "galore2_apollo_8bit": 3823225944,
    "galore2_apollo_mini_8bit": 547276120, "galore2_muon": 12333397832,
    "galore2_muon_polar": 12333397832,
}  # fmt: skip
PUBLISHED_LOW_MEMORY_7B = {
    "torch AdamW fp32": 53907326092, "bitsandbytes AdamW8bit": 13687408768,
    "galore-torch GaLoreAdamW fp32": 18809389056, "galore2 GaLoreAdamW fp32": 18809403208,
    "galore2 8-bit + fp32 basis": 7581318744, "galore2 8-bit + bf16 basis": 5702270552,
    "galore2 8-bit + INT8 basis": 4777426520, "galore2 8-bit + INT4 basis": 4307664472,
    "galore2 8-bit + INT4 basis + Hadamard": 4307664472,
}  # fmt: skip


def test_llama_7b_state_figures_are_the_published_ones():
    """Every 7B state figure of BENCHMARKS.md, byte for byte, from the one calculator."""
    from benchmarks import tiny

    assert llama_7b.state_by_contender(list(CONTENDERS), quick=False) == PUBLISHED_7B
    assert tiny.state_7b_variants(quick=False)[0] == PUBLISHED_LOW_MEMORY_7B
    md = llama_7b.memory_7b(quick=False)
    assert "| torch.optim.AdamW fp32 (counted) | 53.907 | 0.000 | 1,164 | 53.907 |" in md
    assert "| galore2 GaLoreAdamW, rank=None (plain) | 53.907 | 0.000 | 6,984 | 53.907 |" in md


def test_readme_which_optimizer_table_is_the_saved_figures():
    """The "which optimizer" table of docs/guides/choosing.md (and README.md while it holds
    one) is what ``--tasks per_byte`` renders from the committed results (rerun it after a
    suite run); every galore2 row names a real contender."""
    from benchmarks import per_byte

    root = Path(__file__).resolve().parents[2]
    items = per_byte.rows(per_byte.load(root / "benchmarks" / "results"))
    pages = per_byte.pages(root)
    assert pages[0] == root / "docs" / "guides" / "choosing.md"
    for page in pages:
        text = page.read_text()
        assert per_byte.readme_block(text, per_byte.which_md(items)) == text, (
            f"{page.name}'s which-optimizer table is stale: "
            "python -m benchmarks.run --tasks per_byte"
        )
    assert "**galore2" in per_byte.which_md(items)


# --- scale_check (opt-in): the tiny sweep's best lrs on a ~20M-parameter Llama ---------------


def _sweep(*points):
    return [{"lr": lr, "best": best} for lr, best in points]


def test_scale_check_takes_the_best_tiny_lr_and_the_neighbour_toward_the_second_best():
    # the published tiny sweep's shapes: AdamW best 1e-3, second 3e-3 (above)
    assert scale_check.lrs(_sweep((3e-4, 1.9), (1e-3, 1.44), (3e-3, 1.47), (1e-2, 1.9))) == (
        1e-3, 3e-3)  # fmt: skip
    # second best below, and not adjacent: still the next lr on that side
    assert scale_check.lrs(_sweep((1e-3, 1.5), (3e-3, 1.8), (1e-2, 1.2), (3e-2, 1.9))) == (
        1e-2, 3e-3)  # fmt: skip
    # best at the sweep's top edge: the neighbour is below; a diverged lr ranks last
    assert scale_check.lrs(_sweep((3e-3, float("nan")), (1e-2, 1.4), (3e-2, 1.3))) == (3e-2, 1e-2)
    assert scale_check.lrs(_sweep((1e-2, 1.0))) == (1e-2, 3e-3)  # one run (a quick sweep): below
    contenders = [BY_KEY[k] for k in ("adamw", "galore_adamw")]
    tiny = {"adamw": _sweep((1e-3, 1.4), (3e-3, 1.5))}
    assert scale_check.plan(contenders, tiny, quick=False) == {"adamw": (1e-3, 3e-3)}
    assert scale_check.plan(contenders, {}, quick=True) == {
        "adamw": (1e-3, 3e-4), "galore_adamw": (1e-2, 3e-3)}  # fmt: skip


def test_scale_check_resume_keeps_finished_runs_and_saves_after_each(monkeypatch):
    ran, saved = [], []

    def fake(contender, lr, out, steps, config, evals):
        ran.append((contender.key, lr))
        return {"lr": lr, "best": lr}

    monkeypatch.setattr(convergence, "run_one", fake)
    done = {"adamw": [{"lr": 1e-3, "best": 9.0, "config": "c", "steps": 5},
                      {"lr": 3e-3, "best": 9.0, "config": "c", "steps": 4}]}  # fmt: skip
    plan = {"adamw": (1e-3, 3e-3), "galore_adamw": (1e-2, 3e-2)}
    got = scale_check.run(plan, "c", 5, 2, done, lambda r: saved.append(sum(map(len, r.values()))))
    assert ran == [
        ("adamw", 3e-3),
        ("galore_adamw", 1e-2),
        ("galore_adamw", 3e-2),
    ]  # other steps: rerun
    assert got["adamw"][0] == done["adamw"][0] and saved == [2, 3, 4]
    assert all(r["wall_s"] >= 0 and r["eval_every"] == 2 for r in got["galore_adamw"])


def test_scale_check_ranking_verdict():
    labels = {"a": "A", "b": "B", "c": "C"}
    assert "holds" in scale_check.verdict({"a": 1.0, "b": 2.0}, {"a": 1.5, "b": 2.5}, labels)
    text = scale_check.verdict(
        {"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 2.0, "b": 1.0, "c": 3.0}, labels
    )
    assert "Kendall τ = 0.33 over 3" in text and "A and B swapped" in text


def test_scale_check_quick_runs_and_writes_its_section(monkeypatch, tmp_path):
    """``--tasks scale_check --quick`` on a still smaller model (2 steps): it runs every
    contender at two lrs, writes its section, raw results and plot; opt-in, so the default
    suite never runs it."""
    cfg = tmp_path / "micro.toml"
    cfg.write_text(
        "[model]\nvocab_size = 257\ndim = 32\nn_layers = 1\nn_heads = 2\nffn_dim = 64\n"
        "max_seq_len = 32\n[data]\nseq_len = 32\n[optim]\nrank = 8\nupdate_proj_gap = 50\n"
        "[train]\nbatch_size = 2\neval_batches = 1\ncheckpoint_every = -1\n"
    )
    monkeypatch.setattr(scale_check, "QUICK_CONFIG", str(cfg))
    monkeypatch.setattr(scale_check, "QUICK_STEPS", 2)
    out = tmp_path / "B.md"
    argv = ["--tasks", "scale_check", "--quick", "--optimizers", "adamw,galore_adamw",
            "--out", str(out)]  # fmt: skip
    run.main(argv)
    text = out.read_text()
    assert "<!-- BEGIN galore2-bench:suite_scale_check -->" in text
    assert "Command: `python -m benchmarks.run --tasks scale_check --quick" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| torch AdamW (foreach) | "))
    assert "| 0.0003: " in row.replace("**", "") and ", 0.001: " in row.replace("**", "")
    assert row.count("**") == 2  # the best lr in bold
    assert "Wall time: " in text and "for 4 runs" in text
    saved = json.loads((tmp_path / "results" / "suite_scale_check.json").read_text())
    assert [r["lr"] for r in saved["galore_adamw"]] == [1e-2, 3e-3]
    assert not (tmp_path / "results" / "suite_scale_check.partial.json").exists()
    assert (tmp_path / "figures" / "scale_check.png").read_bytes()[:4] == b"\x89PNG"
    # a cut-off task: --partial reports the saved runs, --resume runs only the missing one
    partial = tmp_path / "results" / "suite_scale_check.partial.json"
    saved["galore_adamw"].pop()
    partial.write_text(json.dumps(saved))
    run.main([*argv, "--partial"])
    assert "**Partial: 3 of 4 runs.** The run was cut off before galore2 GaLoreAdamW at 0.003" in (
        out.read_text())  # fmt: skip
    kept = saved["adamw"][0]["wall_s"]
    run.main([*argv, "--resume"])
    again = json.loads((tmp_path / "results" / "suite_scale_check.json").read_text())
    assert again["adamw"][0]["wall_s"] == kept and len(again["galore_adamw"]) == 2
    assert "Partial" not in out.read_text() and not partial.exists()


def test_schedule_tasks_share_their_runs_and_report_every_row(monkeypatch):
    """refresh_schedule and proj_precision: 9 distinct runs on a CPU (the fp32 rows are the
    together rows), done once; every optimizer × schedule / precision has its row."""
    from benchmarks import schedule

    done: list[tuple[str, list[str], bool]] = []

    def fake(name, flags, quick):
        done.append((name, flags, quick))
        bf16 = "bf16" in flags
        return {"val": 2.0 + 0.01 * bf16, "refreshes": 98 if "staggered" in flags else 84,
                "first": 28, "most": 2 if "staggered" in flags else 28, "median_ms": 1.0,
                "worst": 1.0}  # fmt: skip

    monkeypatch.setattr(schedule, "_DONE", {})
    monkeypatch.setattr(schedule, "_measure", fake)
    monkeypatch.setattr(schedule, "_parallel", lambda runs: [fake(*r) for r in runs])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text = schedule.refresh_schedule(quick=True)
    more = schedule.proj_precision(quick=True)
    assert len(done) == 9 and len({schedule._key(*r) for r in done}) == 9
    assert "| GaLoreAdamW | staggered | 2.0000 | 1.0000 | 98 | 28 | 2 |" in text
    assert "| APOLLO | together | 2.0000 | 1.0000 | 84 | 28 | 28 |" in text
    assert "| Fira | bf16 | 2.0100 | 1.0050 |" in more and "tf32" not in more.split("\n\n")[-1]
    assert "T = 20" in text and "60 steps" in text
