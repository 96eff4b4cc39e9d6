"""Block layout of the blockwise Hadamard transform, shared by its kernel and its torch path.

:mod:`galore2.kernels.hadamard` (Triton) and :mod:`galore2.storage.hadamard` (torch)
cut a padded row into the same blocks and refuse the same inputs through
:func:`hadamard_blocks`. It lives here, not in either of them, so that the kernel does not
import its caller and the torch path does not need triton (this module imports nothing).
"""

from __future__ import annotations


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def hadamard_blocks(length: int, block: int) -> tuple[int, int]:
    """(number of full blocks, tail length) of a padded row of ``length`` entries.

    Raises ValueError when ``block`` is not a power of two or the tail is not padded to
    one (see :func:`galore2.storage.hadamard.padded_length`)."""
    if not is_power_of_two(block):
        raise ValueError(f"the Hadamard block must be a power of two, got {block}")
    count = length // block
    tail = length - count * block
    if tail and not is_power_of_two(tail):
        raise ValueError(
            f"row length {length} is not padded for blocks of {block} (see padded_length)"
        )
    return count, tail


__all__ = ["hadamard_blocks", "is_power_of_two"]
