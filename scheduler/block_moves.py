"""Ordering block moves so that none overwrites a block another move has still to read.

A set of ``(src, dst)`` block copies meant to happen at once (every source read before any destination is written)
has to run on the device as a sequence of copy programs, each of which reads its sources before writing its
destinations, but only within itself. :func:`order_block_moves` groups the copies into rounds that can run in any
order within a round (in any number of chunks) and must run round after round. The compaction plans of
``BlockPool.compact`` never chain (every destination there is an empty block), so they come back as one round.
"""

from __future__ import annotations

from typing import Sequence


def order_block_moves(pairs: Sequence[tuple[int, int]], scratch: int = 0) -> list[list[tuple[int, int]]]:
    """Rounds of copies doing ``pairs`` as if every source were read first.

    A copy is ready once its destination is no pending copy's source; a chain ``a -> b -> c`` thus runs
    ``b -> c`` before ``a -> b``. When nothing is ready, what is left is cycles: one block of a cycle is saved into
    ``scratch`` (by default the null block 0, whose contents no request ever reads) and its readers read it there.

    Args:
      pairs: ``(src, dst)`` block ids; destinations distinct; ``src == dst`` copies are dropped.
      scratch: a block no pair reads or writes.

    Returns:
      the rounds, each a list of ``(src, dst)``; no round writes a block that a later round reads.

    Raises:
      ValueError: two pairs write one block, or a pair uses ``scratch``.
    """
    pending: dict[int, int] = {}
    for src, dst in pairs:
        if scratch in (src, dst):
            raise ValueError(f"order_block_moves: the pair ({src}, {dst}) uses the scratch block {scratch}")
        if dst in pending:
            raise ValueError(f"order_block_moves: block {dst} is written by two pairs")
        if src != dst:
            pending[dst] = src
    rounds = []
    while pending:
        sources = set(pending.values())
        ready = [(src, dst) for dst, src in pending.items() if dst not in sources]
        if not ready:
            saved = next(iter(pending))
            ready = [(saved, scratch)]
            pending = {dst: scratch if src == saved else src for dst, src in pending.items()}
        for _, dst in ready:
            pending.pop(dst, None)
        rounds.append(ready)
    return rounds
