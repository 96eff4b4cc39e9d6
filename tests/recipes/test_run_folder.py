"""One writer per run folder, and refusals that change nothing (issue 39 items 3, 10, 11,
12, 13).

Item 3: a second process resuming into an out dir a run is using dropped the first's
metrics rows and rewrote its config.json; the out dir's lock is now held for the whole run.
Item 10: ``--model.vocab_size`` below the tokenizer's ids was a warning then an
IndexError, after ``--train.overwrite`` had deleted the old run. Item 11: a save failing
inside DCP printed a traceback. Item 12: ``OUT/.lock`` being a folder. Item 13:
``--optim.target_modules`` matching nothing only warned (and the run was labelled GaLore).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.pretrain import main

from .test_cli_errors import _error_line
from .test_recipe import SMALL

ROOT = Path(__file__).resolve().parents[2]
FIRST = ["--steps", "4", "--train.checkpoint_every", "2"]


def _snapshot(out: Path) -> dict[str, bytes]:
    """Every file under ``out`` with its bytes."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def _first_run(out: Path) -> dict[str, bytes]:
    main([*SMALL, *FIRST, "--out", str(out)])
    return _snapshot(out)




# --- item 3 ----------------------------------------------------------------------------

HOLDER = r"""
import sys, time
from pathlib import Path
from recipes import resume
from recipes.resolve import parse_args

argv, go = sys.argv[1:-1], Path(sys.argv[-1])
with resume.prepare(parse_args(argv)):  # a resumed run, between its start and its end
    print("running", flush=True)
    while not go.exists():
        time.sleep(0.05)
print("ended", flush=True)
"""


def test_a_second_process_on_a_run_folder_is_refused_and_changes_nothing(tmp_path, capsys):
    out, go = tmp_path / "out", tmp_path / "go"
    before = _first_run(out)
    argv = [*SMALL, "--steps", "8", "--train.checkpoint_every", "2", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *argv, str(go)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in proc.stdout:  # after what resuming prints
            if line.strip() == "running":
                break
        else:
            pytest.fail("the first run did not start")
        line = _error_line(capsys, [*argv, "--optim.lr", "0.5"])
        assert f"another process is running in {out} (pid {proc.pid} on " in line
        assert "one writer for the whole run" in line
        lock = out / ".lock"
        assert _snapshot(out) == {**before, ".lock": lock.read_bytes()}  # nothing changed
    finally:
        go.touch()
        rest, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and rest.strip().endswith("ended"), err[-2000:]
    assert _snapshot(out) == before  # the lock file goes with its holder
    rows = main(argv)  # the folder is free again: the run continues
    assert [r["step"] for r in rows] == [6, 8]


def test_a_lock_left_by_a_dead_run_does_not_block(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text("pid 1 on elsewhere\n")  # the kernel's flock died with it
    rows = main([*SMALL, *FIRST, "--out", str(out)])
    assert [r["step"] for r in rows] == [2, 4] and not (out / ".lock").exists()


# --- item 10 and item 13 (refused before the old run is deleted) ---------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--model.vocab_size", "100"],
         "model.vocab_size=100 is smaller than the ids the tokenizer produces"),
        (["--optim.target_modules", "nothing_matches"],
         "optim.target_modules=['nothing_matches'] selects no module"),
    ],
    ids=["vocab_size", "target_modules"],
)  # fmt: skip
def test_a_refused_setting_leaves_the_run_that_overwrite_would_delete(
    tmp_path, capsys, bad, message
):
    out = tmp_path / "out"
    before = _first_run(out)
    capsys.readouterr()
    argv = [*SMALL, *FIRST, "--out", str(out), "--train.overwrite", "true", *bad]
    line = _error_line(capsys, argv)
    assert message in line
    assert _snapshot(out) == before


def test_a_refused_fresh_run_leaves_no_out_dir(tmp_path, capsys):
    out = tmp_path / "new"
    line = _error_line(capsys, [*SMALL, *FIRST, "--out", str(out), "--model.vocab_size", "100"])
    assert "model.vocab_size=100" in line and not out.exists()


# --- item 11 and item 12 -------------------------------------------------------------------


def test_a_save_failing_inside_dcp_is_one_error_line_and_keeps_the_checkpoints(
    tmp_path, capsys
):
    out = tmp_path / "out"
    main([*SMALL, *FIRST, "--train.stop_after", "2", "--out", str(out)])
    ckpt = out / "checkpoints"
    before = _snapshot(ckpt)
    (ckpt / ".tmp-step-00000004").write_text("in the way")  # where DCP writes step 4
    capsys.readouterr()
    line = _error_line(capsys, [*SMALL, *FIRST, "--out", str(out)])
    assert f"cannot save a checkpoint into {ckpt}: writing .tmp-step-00000004 failed" in line
    assert "the checkpoints already there are untouched" in line
    after = _snapshot(ckpt)
    assert after.pop(".tmp-step-00000004") == b"in the way" and after == before


def test_a_folder_where_the_run_lock_goes_is_one_error_line(tmp_path, capsys):
    out = tmp_path / "out"
    (out / ".lock").mkdir(parents=True)
    line = _error_line(capsys, [*SMALL, *FIRST, "--out", str(out)])
    assert f"cannot lock {out / '.lock'} (it is a folder)" in line
    assert [p.name for p in out.iterdir()] == [".lock"]


def test_special_tokens_at_the_end_of_the_vocabulary_warn_text_ids_refuse(tmp_path):
    """T5's case: 100 sentinel ids after the text ids (a model sized 32000 for a 32100-id
    tokenizer is the GaLore papers' setup): a warning, not an error."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    from recipes.tokenizer import check_vocab_size, load_tokenizer, text_ids

    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"])
    tk.train_from_iterator(["alpha beta gamma delta", "river stone"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": [f"<extra_id_{i}>" for i in range(3)]})
    fast.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert (tok.vocab_size, text_ids(tok)) == (11, 8)
    check_vocab_size(tok, 11)  # silent
    with pytest.warns(UserWarning, match="covers the 8 that text produces"):
        check_vocab_size(tok, 8)
    with pytest.raises(ValueError, match=r"model\.vocab_size=7 is smaller .* ids up to 7"):
        check_vocab_size(tok, 7)
