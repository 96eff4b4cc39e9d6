"""The recipe with the benchmarks' peers: ``python -m benchmarks.pretrain [recipe arguments]``.

    python -m benchmarks.pretrain --config tiny --optimizer gt_galore_adamw --optim.lr 1e-2

Every argument of ``python -m recipes.pretrain``; ``--optimizer`` may also name a peer of
:data:`benchmarks.peers.PEERS` (galore-torch, apollo-torch, fira, pytorch-optimizer: the
``bench`` extra). The runs of the benchmarks' tables are this command, in process
(:func:`benchmarks._common.tiny_run`).
"""

from __future__ import annotations

from recipes.cli import run_cli
from recipes.pretrain import main as recipe_main

from .peers import PEERS


def main(argv: list[str] | None = None) -> list[dict]:
    """:func:`recipes.pretrain.main` given :data:`~benchmarks.peers.PEERS`."""
    return recipe_main(argv, PEERS)


if __name__ == "__main__":
    run_cli(main)
