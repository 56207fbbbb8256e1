"""Ordering block moves so that none overwrites a block another move has still to read."""

from __future__ import annotations

from typing import Sequence


def order_block_moves(pairs: Sequence[tuple[int, int]], scratch: int = 0) -> list[list[tuple[int, int]]]:
    """Rounds of copies doing ``pairs`` as if every source were read first.

    Within a round copies run in any order and chunking; rounds run in order, none writing what a later round
    reads. A chain ``a -> b -> c`` runs ``b -> c`` first; a cycle saves one block into ``scratch`` (default the
    null block 0, which no request reads).

    Args:
      pairs: ``(src, dst)`` block ids, destinations distinct; ``src == dst`` dropped.
      scratch: a block no pair reads or writes.

    Raises ValueError if two pairs write one block or a pair uses ``scratch``.
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
