"""``is_dtensor``: galore2's one DTensor detector.

Cheap and import-free: a DTensor can only exist once ``torch.distributed.tensor`` has
been imported (its class lives there), so the class is looked up in ``sys.modules``
instead of being imported. ``import galore2`` therefore never imports
``torch.distributed.tensor`` (nor needs a torch built with distributed support), and
a process that never made a DTensor pays one dictionary lookup per call.
"""

from __future__ import annotations

import sys

_MODULE = "torch.distributed.tensor"


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor — an FSDP2 / HSDP parameter (a Parameter holding a
    DTensor is one), its gradient or a state tensor laid out on its mesh."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(t, module.DTensor)


__all__ = ["is_dtensor"]
