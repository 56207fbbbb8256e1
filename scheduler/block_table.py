"""A persistent numpy block table: one row per request holding device blocks."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """``table: int32[rows, width]``, row r holding one request's block ids, zero past its length.

    Kept in step with the KV cache manager's lists so ``build_batch`` gathers
    all rows with one fancy index instead of converting Python lists every
    step (vLLM v1 ``BlockTable`` in the runner's ``InputBatch`` does the same).
    Both dimensions grow by doubling on demand; rows are recycled and zeroed
    when a request lets go of its blocks.
    """

    def __init__(self, rows: int = 8, width: int = 8) -> None:
        self.table = np.zeros((max(rows, 1), max(width, 1)), dtype=np.int32)
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))
        self._lengths: dict[int, int] = {}

    def acquire(self) -> int:
        """A zeroed row for a new holder."""
        if not self._free_rows:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._lengths[row] = 0
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        """Write ``block_ids`` after the row's current entries."""
        start = self._lengths[row]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            width = self.table.shape[1]
            while width < end:
                width *= 2
            self.table = np.pad(self.table, ((0, 0), (0, width - self.table.shape[1])))
        self.table[row, start:end] = block_ids
        self._lengths[row] = end

    def release(self, row: int) -> None:
        """Zero the row and make it reusable."""
        self.table[row, : self._lengths.pop(row)] = 0
        self._free_rows.append(row)
