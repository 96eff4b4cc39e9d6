"""torchtitan on one GPU: the guide's command with the debug model, loss falling, a checkpoint
saved and resumed (issue 28 item 5).

    python -m benchmarks.torchtitan_gpu --out runs/torchtitan     # needs CUDA and torchtitan

Runs docs/guides/torchtitan.md's command (``torchrun ... -m torchtitan.train --module
galore2.integrations.torchtitan --config llama3_debugmodel_galore``; with torchtitan 0.2.x,
the same model and settings through its ``[optimizer]`` section: :func:`train_args`) on
one GPU twice in a work folder under ``--out``:

1. ``--steps`` steps (10) with a checkpoint at the last one;
2. the same command with ``--resume-steps`` (15): torchtitan loads that checkpoint and
   trains on.

torchtitan's debug config reads ``./tests/assets/c4_test`` and ``./tests/assets/tokenizer``
from its own repository, which its wheel does not ship (and the GPU machine has no network):
``prepare_assets`` writes both into the work folder, offline: the recipe's embedded corpus
as JSON lines and a byte-level BPE tokenizer (vocabulary 2000 < the debug model's 2048)
trained on it with ``tokenizers``. Checked (``check``): the first run's loss falls (the
mean of its last three steps below its first step's), the checkpoint folder ``step-N``
exists, the second run says it loaded it and starts at step N + 1, and logs every step
up to the new end. Logs go to ``--out`` (``run1.log``, ``run2.log``); a JSON summary is
printed; the exit status is 1 if a check fails. tests/integrations/test_torchtitan_gpu.py
runs the CPU parts (assets, the command through torchtitan's parser, the checks on logs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "llama3_debugmodel_galore"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB = 2000  # below the debug model's 2048 embedding rows
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eE]+|nan|inf)")


def prepare_assets(work: Path) -> Path:
    """torchtitan's ``tests/assets/{c4_test,tokenizer}`` under ``work``, made offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from recipes.corpus import embedded_documents

    docs = embedded_documents()
    data = work / "tests" / "assets" / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "train.jsonl", "w") as f:  # the file name is the split
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    assets = work / "tests" / "assets" / "tokenizer"
    assets.mkdir(parents=True, exist_ok=True)
    tok.save(str(assets / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False}
    (assets / "tokenizer_config.json").write_text(json.dumps(config))
    return work


def train_args(steps: int, interval: int, dump: str, api: str | None = None) -> list[str]:
    """torchtitan.train's arguments: the guide's debug-model command for the installed
    torchtitan (``api``: ``galore2.integrations.torchtitan.API``, ``"0.3"`` or ``"0.2"``),
    plus steps and a checkpoint. 0.2.x: its ``[optimizer]`` section with the debug model's
    settings of 0.3.x's ``llama3_debugmodel_galore`` (``GALORE_DEBUG``)."""
    if api is None:
        from galore2.integrations.torchtitan import API as api
    common = ["--training.steps", str(steps),
              "--checkpoint.enable", "--checkpoint.interval", str(interval),
              "--metrics.disable_color_printing"]  # fmt: skip
    if api == "0.3":
        return ["--module", "galore2.integrations.torchtitan", "--config", CONFIG,
                *common, "--dump_folder", dump]  # fmt: skip
    from galore2.integrations.torchtitan.common import GALORE_DEBUG as s

    beta1, beta2 = s["betas"]
    galore = ",".join(f"{k}={s[k]}" for k in ("rank", "update_proj_gap", "scale"))
    return [
        "--job.custom_config_module", "galore2.integrations.torchtitan.job_config",
        "--model.name", "llama3_galore", "--model.flavor", "debugmodel",
        "--optimizer.name", "galore_adamw", "--optimizer.lr", str(s["lr"]),
        "--optimizer.beta1", str(beta1), "--optimizer.beta2", str(beta2),
        "--optimizer.eps", str(s["eps"]), "--optimizer.weight_decay", str(s["weight_decay"]),
        "--optimizer.galore_options", galore, *common, "--job.dump_folder", dump,
    ]  # fmt: skip


def command(steps: int, interval: int, dump: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "1", "-m", "torchtitan.train", *train_args(steps, interval, dump)]  # fmt: skip


def losses(log: str) -> dict[int, float]:
    """{step: loss} from torchtitan's log lines (``step:  3  loss:  7.12345 ...``)."""
    return {int(m[1]): float(m[2]) for m in STEP_LINE.finditer(log)}


def check(first: str, second: str, steps: int, resume_steps: int, dump: Path) -> list[str]:
    """What failed (empty: every check passed), from the two runs' logs and the dump folder."""
    bad = []
    a, b = losses(first), losses(second)
    if sorted(a) != list(range(1, steps + 1)):
        bad.append(f"run 1 logged steps {sorted(a)}, expected 1..{steps}")
    elif not sum(a[s] for s in range(steps - 2, steps + 1)) / 3 < a[1]:
        bad.append(f"run 1: loss did not fall ({a[1]:.4f} at step 1, last {a[steps]:.4f})")
    if not (dump / "checkpoint" / f"step-{steps}").is_dir():
        bad.append(f"no checkpoint folder {dump / 'checkpoint' / f'step-{steps}'}")
    if "Loading the checkpoint from" not in second:
        bad.append("run 2 did not load a checkpoint")
    if f"Training starts at step {steps + 1}" not in second:
        bad.append(f"run 2 did not start at step {steps + 1}")
    if sorted(b) != list(range(steps + 1, resume_steps + 1)):
        bad.append(f"run 2 logged steps {sorted(b)}, expected {steps + 1}..{resume_steps}")
    elif not all(v == v and abs(v) != float("inf") for v in b.values()):
        bad.append("run 2: a non-finite loss")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.torchtitan_gpu", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="work folder and logs")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--resume-steps", type=int, default=15)
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    args = p.parse_args(argv)
    if args.resume_steps <= args.steps or args.steps < 4:
        p.error("need --steps >= 4 and --resume-steps > --steps")
    work = prepare_assets(args.out.resolve())
    dump = work / "dump"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    logs = []
    for i, steps in enumerate((args.steps, args.resume_steps), 1):
        cmd = command(steps, args.steps, str(dump))
        try:
            done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                                  timeout=args.timeout, check=False)  # fmt: skip
            log, rc = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            log, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {args.timeout} s", -1
        (args.out / f"run{i}.log").write_text(" ".join(cmd) + "\n\n" + str(log))
        logs.append(str(log))
        if rc:
            print(json.dumps({"ok": False, "failed": [f"run {i} exited {rc}"],
                              "log": str(args.out / f"run{i}.log")}))  # fmt: skip
            return 1
    bad = check(logs[0], logs[1], args.steps, args.resume_steps, dump)
    print(json.dumps({"ok": not bad, "failed": bad, "losses_run1": losses(logs[0]),
                      "losses_run2": losses(logs[1])}))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
