"""``python -m galore2.plan CONFIG``: see :mod:`galore2.plan`."""

from .cli import run

if __name__ == "__main__":
    run()
