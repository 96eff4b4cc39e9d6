"""Walk an ``--optim.KEY`` setting from ``python -m recipes.pretrain`` to the math.

    python -m tools.walk_setting                 # --optim.rank 7 (tiny, 1 step, CPU)
    python -m tools.walk_setting --key update_proj_gap --value 9
    python -m tools.walk_setting --key proj_precision --value bf16 --until projection_precision

Runs one step of the tiny recipe under a profiler and lists, in call order, every Python
function of the checkout (galore2/, recipes/; run from its root) that is handed the
setting, up to the first call of ``--until`` (default ``GaLore.init``, where a rank becomes
the subspace's shape; ``projection_precision`` is where a precision sets the projection's
matmuls): a call is handed it when an argument is the value itself (the command-line string
or the parsed int) or holds it (a mapping such as a param group or ``optim.options``, an
object whose ``KEY`` attribute or ``options[KEY]`` is it, a list of such groups); with
``--readers`` a holder counts only when the function's code names ``KEY`` (a constant, an
attribute or a variable). It prints the
walk and the number of file changes (consecutive calls in different files) over the
number of files.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path.cwd().resolve()  # the checkout walked (run from its root)
PACKAGES = ("galore2", "recipes")


def _is(v: Any, value: int | str, text: str) -> bool:
    return type(v) in (int, str) and v in (value, text)


def _holds(x: Any, key: str, value: int | str, text: str, depth: int = 0) -> bool:
    if isinstance(x, str):
        return x == text
    if isinstance(x, Mapping):
        try:  # a check's view (galore2.core.options.Seen) refuses a key it does not declare
            return _is(x.get(key), value, text)
        except (KeyError, AttributeError):  # (AttributeError: a view not yet made)
            return False
    if isinstance(x, (list, tuple)) and depth == 0:
        return any(_holds(v, key, value, text, 1) for v in x[:8])
    if isinstance(x, type):
        return False
    options = getattr(x, "options", None)
    in_options = isinstance(options, Mapping) and _is(options.get(key), value, text)
    return in_options or _is(getattr(x, key, None), value, text)


def walk(
    key: str, value: int | str, text: str, readers: bool, until: str = "GaLore.init"
) -> list[tuple[str, str]]:
    from recipes.pretrain import main

    steps: list[tuple[str, str]] = []
    done = False
    where: dict[str, Path | None] = {}  # a code object's file, relative to ROOT (None: not ours)

    def _ours(filename: str) -> Path | None:
        try:
            rel = Path(filename).resolve().relative_to(ROOT)
        except ValueError:
            return None
        return rel if rel.parts[0] in PACKAGES else None

    def profile(frame, event, arg):
        nonlocal done
        if done or event != "call":
            return
        code = frame.f_code
        if code.co_filename not in where:
            where[code.co_filename] = _ours(code.co_filename)
        rel = where[code.co_filename]
        if rel is None:
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        args = [frame.f_locals.get(n) for n in names]
        handed = any(_is(a, value, text) for a in args)  # the value itself
        reads = key in code.co_consts or key in code.co_names or key in code.co_varnames
        holds = any(_holds(a, key, value, text) for a in args)
        if handed or (holds and (reads or not readers)):
            steps.append((str(rel), code.co_qualname))
        if code.co_qualname == until:
            done = True
            sys.setprofile(None)  # the rest of the run is not walked

    with tempfile.TemporaryDirectory() as out:
        argv = ["--config", "tiny", "--steps", "1", "--out", out, "--train.progress", "false",
                "--train.eval_batches", "0", f"--optim.{key}", text]  # fmt: skip
        sys.setprofile(profile)
        try:
            main(argv)
        finally:
            sys.setprofile(None)
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--key", default="rank")
    p.add_argument("--value", default="7", help="as on the command line (an int is parsed)")
    p.add_argument("--until", default="GaLore.init",
                   help="the qualified name of the function where the walk ends (the math)")  # fmt: skip
    p.add_argument("--readers", action="store_true",
                   help="only calls given the value itself or whose code names KEY")  # fmt: skip
    ns = p.parse_args(argv)
    value = int(ns.value) if ns.value.lstrip("-").isdigit() else ns.value
    steps = walk(ns.key, value, ns.value, ns.readers, ns.until)
    changes, last = 0, None
    for path, name in steps:
        moved = last is not None and path != last
        changes += moved
        print(f"{'→' if moved else ' '} {path}: {name}")
        last = path
    files = sorted({path for path, _ in steps})
    print(f"--optim.{ns.key}: {changes} file changes over {len(files)} files: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
