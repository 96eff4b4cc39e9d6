"""A run recorded before lr, weight_decay, betas and eps became galore2's options (main at
7b2a3db: [optim] fields ``lr``, ``weight_decay``, ``beta1``, ``beta2``, ``eps``) resumes:
its settings are compared with today's, none changed silently or ignored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from recipes.resolve import parse_args, recorded
from recipes.resume import compare

from .test_recipe import run
from .test_resume import _record, _steps

#: the [optim] sections main (7b2a3db) wrote into config.json and its checkpoints for
#: ``--config tiny`` and the flags named (copied from its output, as JSON; key order aside)
_REST = {"target_modules": ["attn", "mlp"], "per_layer": False, "max_grad_norm": 0.0,
         "warmup_steps": 0, "warmup_ratio": 0.1, "min_lr_ratio": 0.1, "capture": False,
         "adamw_kernel": "auto", "fixed": {}}  # fmt: skip
_TINY_OPTIONS = {"rank": 32, "update_proj_gap": 50, "scale": 0.25}
MAIN_OPTIM = {
    # --optim.lr 0.02 --optim.beta2 0.95 --optim.weight_decay 0.1 --optim.eps 1e-7
    "galore_adamw": {"name": "galore_adamw", "lr": 0.02, "weight_decay": 0.1, "beta1": 0.9,
                     "beta2": 0.95, "eps": 1e-07, **_REST, "options": _TINY_OPTIONS},
    # --optim.eps 1e-30,1e-3 --optim.beta1 0.9 (GaLoreAdafactor's own eps and beta1; the
    # fields beta1 / beta2 / eps were Adam's, which Adafactor does not read)
    "galore_adafactor": {"name": "galore_adafactor", "lr": 0.01, "weight_decay": 0.0,
                         "beta1": 0.9, "beta2": 0.999, "eps": 1e-08, **_REST,
                         "options": {**_TINY_OPTIONS, "eps": [1e-30, 0.001], "beta1": 0.9}},
    # --optim.beta1 0.8
    "adamw": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0, "beta1": 0.8, "beta2": 0.999,
              "eps": 1e-08, **_REST, "options": _TINY_OPTIONS},
}  # fmt: skip

TINY = ["--config", "tiny"]


def _old(name: str, *argv: str) -> dict:
    """A config.json of main's layout: today's other sections, main's [optim] section."""
    config = json.loads(json.dumps(parse_args([*TINY, "--optimizer", name, *argv]).to_dict()))
    return {**config, "optim": MAIN_OPTIM[name]}


def test_a_config_of_main_reads_in_todays_layout():
    """The fields that became options move into ``options``; Adam's ``beta1``/``beta2``
    become ``betas``; GaLoreAdafactor's Adam ``eps`` field (read by nothing) is dropped, its
    own ``eps`` and ``beta1`` stay."""
    adamw = recorded(MAIN_OPTIM["galore_adamw"])
    assert adamw["options"] == {"lr": 0.02, "weight_decay": 0.1, "eps": 1e-07,
                                "betas": [0.9, 0.95], "rank": 32, "update_proj_gap": 50,
                                "scale": 0.25}  # fmt: skip
    assert not {"lr", "weight_decay", "beta1", "beta2", "eps"} & set(adamw)
    ada = recorded(MAIN_OPTIM["galore_adafactor"])["options"]
    assert ada == {"lr": 0.01, "weight_decay": 0.0, "betas": [0.9, 0.999], "rank": 32,
                   "update_proj_gap": 50, "scale": 0.25, "eps": [1e-30, 0.001],
                   "beta1": 0.9}  # fmt: skip
    today = json.loads(json.dumps(parse_args([*TINY, "--optim.rank", "8"]).to_dict()))["optim"]
    assert recorded(today) == today  # today's layout reads as it is


def test_main_config_resumes_with_the_same_settings_and_reports_each_change():
    same = ["--optim.lr", "0.02", "--optim.betas", "0.9,0.95", "--optim.weight_decay", "0.1",
            "--optim.eps", "1e-7"]  # fmt: skip
    old = _old("galore_adamw", *same)
    assert compare(old, parse_args([*TINY, *same])) == ({}, {})
    legacy = [*same[:2], "--optim.beta2", "0.95", *same[4:]]  # main's spelling, still read
    assert compare(old, parse_args([*TINY, *legacy])) == ({}, {})
    # every setting left out goes back to its value in force, and is reported
    changes, refused = compare(old, parse_args(TINY))
    assert refused == {} and changes == {
        "optim.lr": (0.02, 0.01),  # tiny.toml's
        "optim.betas": ([0.9, 0.95], [0.9, 0.999]),  # galore2's default
        "optim.weight_decay": (0.1, 0.0),  # tiny.toml's (and RECIPE_DEFAULTS')
        "optim.eps": (1e-07, 1e-08),  # galore2's default
    }
    # an option declared not resumable is still refused for a config of main
    changes, refused = compare(old, parse_args([*TINY, *same, "--optim.rank", "16"]))
    assert refused == {"optim.rank": (32, 16)} and changes == {}


def test_main_config_of_other_optimizers_resumes():
    ada = ["--optim.eps", "1e-30,1e-3", "--optim.beta1", "0.9"]
    old = _old("galore_adafactor", *ada)
    assert compare(old, parse_args([*TINY, "--optimizer", "galore_adafactor", *ada])) == ({}, {})
    changes, _ = compare(old, parse_args([*TINY, "--optimizer", "galore_adafactor"]))
    assert changes == {"optim.eps": ([1e-30, 0.001], [None, 0.001]), "optim.beta1": (0.9, None)}
    old = _old("adamw", "--optim.beta1", "0.8")
    same = parse_args([*TINY, "--optimizer", "adamw", "--optim.betas", "0.8,0.999"])
    assert compare(old, same) == ({}, {})
    changes, refused = compare(old, parse_args([*TINY, "--optimizer", "adamw"]))
    assert refused == {} and changes == {"optim.betas": ([0.8, 0.999], [0.9, 0.999])}


def _as_main(optim: dict) -> dict:
    """Today's [optim] section rewritten in main's layout (fields lr ... eps)."""
    options = dict(optim["options"])
    b1, b2 = options.pop("betas", (0.9, 0.999))
    fields = {"lr": options.pop("lr", 1e-3), "weight_decay": options.pop("weight_decay", 0.0),
              "beta1": b1, "beta2": b2, "eps": options.pop("eps", 1e-8)}  # fmt: skip
    return {"name": optim["name"], **fields,
            **{k: v for k, v in optim.items() if k not in ("name", "options")},
            "options": options}  # fmt: skip


def test_a_run_recorded_by_main_resumes(tmp_path):
    """End to end: a run whose config.json and checkpoint record main's layout resumes
    with the settings it had, and a changed lr is applied from the next step and recorded."""
    out = tmp_path / "run"
    given = ["--optim.lr", "0.02", "--optim.beta2", "0.95", "--train.checkpoint_every", "4"]
    run(out, "--steps", "4", *given)
    assert _steps(out) == [4]
    saved = _record(out, 4)
    saved["meta"]["config"]["optim"] = main = _as_main(saved["meta"]["config"]["optim"])
    assert (main["lr"], main["beta2"]) == (0.02, 0.95)  # main's layout, as main wrote it
    (out / "checkpoints" / "step-00000004" / "galore2.json").write_text(json.dumps(saved))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "optim": main}))
    other = shutil.copytree(out, tmp_path / "other")

    def changes(folder: Path) -> dict:
        config = json.loads((folder / "config.json").read_text())
        return {c["key"]: (c["step"], c["from"], c["to"]) for c in config["changes"]}

    assert [r["step"] for r in run(out, "--steps", "6", *given)] == [6]
    assert changes(out) == {"train.steps": (4, 4, 6)}
    run(other, "--steps", "6", *given, "--optim.lr", "0.03")
    assert changes(other) == {"train.steps": (4, 4, 6), "optim.lr": (4, 0.02, 0.03)}
