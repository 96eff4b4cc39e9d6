"""User errors of the recipe print one ``error:`` line and exit 2, no traceback (issue 30
item 6): a text dataset that is not UTF-8, ``--train.device cuda`` without CUDA, ``--out``
naming a file, ``--train.resume false`` over a run."""

from __future__ import annotations

import re

import pytest
import torch

from recipes.cli import run_cli
from recipes.pretrain import main

from .test_data import offline  # noqa: F401  (a fixture)
from .test_recipe import SMALL


def _error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        run_cli(main, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("error: "), err
    return lines[-1]


def test_text_dataset_that_is_not_utf8(tmp_path, capsys, offline):  # noqa: F811
    data = tmp_path / "latin1.txt"
    data.write_bytes("a first paragraph\n\ncafé au lait\n".encode("latin-1"))
    line = _error_line(capsys, [*SMALL, "--data.dataset", str(data), "--out", str(tmp_path / "o")])
    assert f"{data} is not UTF-8 text (byte 0xe9 at offset 22)" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a CUDA device")
def test_device_cuda_without_cuda(tmp_path, capsys):
    line = _error_line(capsys, [*SMALL, "--train.device", "cuda", "--out", str(tmp_path)])
    assert re.search(r"train\.device cuda: this torch .* (built without CUDA|no CUDA device)", line)


def test_out_naming_a_file(tmp_path, capsys):
    out = tmp_path / "a_file"
    out.write_text("x")
    line = _error_line(capsys, [*SMALL, "--out", str(out)])
    assert line == f"error: train.out {out} is a file; --out must name a folder"


def test_fresh_run_over_a_run(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    line = _error_line(capsys, [*SMALL, "--out", str(tmp_path), "--train.resume", "false"])
    assert f"{tmp_path} already holds a run (metrics.jsonl)" in line
