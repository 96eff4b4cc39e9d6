"""Smoke steps of every public galore2 optimizer, run by tests/test_wheel.py in a fresh venv.

Imports only torch and galore2 (the installed wheel, never this repository; the planner
also transformers, to build a Hugging Face config on the meta device): a tiny
language model (embedding, two linear layers) takes two steps with each optimizer class in
``galore2.__all__``; its matrices in a GaLore group where the optimizer has one. Prints one
JSON object: where galore2 and its metadata were found, and per optimizer the two losses,
whether the parameters moved, and the dtypes of its state; and the memory planner's
optimizers on a config.json written in a temporary folder.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math

import torch
from torch import nn

import galore2

# constructor arguments an optimizer needs beyond its groups and lr
EXTRA = {"Ranger21": {"num_iterations": 10}, "GaLoreRanger21": {"num_iterations": 10}}


def public_optimizers() -> list[str]:
    """The names in ``galore2.__all__`` that are ready-made optimizers: subclasses of
    ``torch.optim.Optimizer`` other than the chain every preset builds on."""
    return [
        name
        for name in galore2.__all__
        if isinstance(obj := getattr(galore2, name), type)
        and issubclass(obj, torch.optim.Optimizer)
        and obj is not galore2.ChainOptimizer
    ]


def smoke(name: str) -> dict:
    """Two steps of ``galore2.<name>`` on a 64-token-vocabulary model; the 64×64 embedding
    (4096 elements) is large enough for GaLoreAdamW8bit's 8-bit moments."""
    torch.manual_seed(0)
    cls = getattr(galore2, name)
    model = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 64))
    mats = [model[1].weight, model[3].weight]
    rest = [p for p in model.parameters() if all(p is not m for m in mats)]
    galore = {}
    if "rank" in cls.declared_options():
        galore = {"rank": getattr(cls, "projected_rank", None) or 4, "update_proj_gap": 1}
    opt = cls([{"params": mats, **galore}, {"params": rest}], lr=1e-2, **EXTRA.get(name, {}))
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    dtypes = {str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}
    return {
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
        "moved": moved,
        "state_dtypes": sorted(dtypes),
    }


def planner() -> dict:
    """``python -m galore2.plan config.json`` in a temporary folder (the planner never
    imports the recipe of a checkout): its rows' optimizers and state bytes, whether
    ``recipes`` was imported or could be, and ``sys.path``."""
    import contextlib
    import io
    import os
    import sys
    import tempfile

    from galore2.plan import cli

    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            with open("config.json", "w") as f:
                json.dump(config, f)
            with contextlib.redirect_stdout(io.StringIO()) as out:
                cli.main(["config.json", "--json"])
        finally:
            os.chdir(here)
    rows = json.loads(out.getvalue())["rows"]
    return {
        "optimizers": list(dict.fromkeys(r["optimizer"] for r in rows)),
        "states": [r["state"] for r in rows],
        "recipes_imported": sorted(m for m in sys.modules if m.split(".")[0] == "recipes"),
        "recipes_findable": importlib.util.find_spec("recipes") is not None,
        "path": sys.path,
    }


def main() -> None:
    """Print the JSON report on one line."""
    torch.set_num_threads(1)
    dist = importlib.metadata.distribution("galore2")
    report = {
        "file": galore2.__file__,
        "version": galore2.__version__,
        "metadata_version": dist.version,
        "metadata_init": str(dist.locate_file("galore2/__init__.py")),
        "optimizers": {name: smoke(name) for name in public_optimizers()},
        "planner": planner(),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
