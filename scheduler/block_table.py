"""A persistent numpy block table: one row per request holding device blocks."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """``table: int32[rows, width]``, row r holding one request's block ids, zero past ``lengths[r]`` (int32[rows],
    0 for a free row); kept in step with the ``KVCacheManager`` lists (vLLM v1's ``BlockTable``). Grows by doubling."""

    def __init__(self, rows: int = 8, width: int = 8) -> None:
        self.table = np.zeros((max(rows, 1), max(width, 1)), dtype=np.int32)
        self.lengths = np.zeros(self.table.shape[0], dtype=np.int32)
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))

    def acquire(self) -> int:
        """A zeroed row for a new holder."""
        if not self._free_rows:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def append(self, row: int, block_ids: list[int]) -> None:
        """Write ``block_ids`` after the row's current entries."""
        start = int(self.lengths[row])
        end = start + len(block_ids)
        self._fit(end)
        self.table[row, start:end] = block_ids
        self.lengths[row] = end

    def append_rows(self, rows: np.ndarray, counts: np.ndarray, block_ids: list[int]) -> None:
        """Write ``counts[i]`` of ``block_ids``, in order, after the entries of each of ``rows`` (distinct rows)."""
        starts = self.lengths[rows]
        ends = starts + counts
        self._fit(int(ends.max(initial=0)))
        if len(block_ids) == len(rows):
            self.table[rows, starts] = block_ids
        else:
            firsts = counts.cumsum() - counts
            offsets = np.arange(len(block_ids)) - (firsts - starts).repeat(counts)
            self.table[rows.repeat(counts), offsets] = block_ids
        self.lengths[rows] = ends

    def _fit(self, width: int) -> None:
        if width > self.table.shape[1]:
            new_width = self.table.shape[1]
            while new_width < width:
                new_width *= 2
            self.table = np.pad(self.table, ((0, 0), (0, new_width - self.table.shape[1])))

    def release(self, row: int) -> None:
        """Zero the row and make it reusable."""
        self.table[row, : self.lengths[row]] = 0
        self.lengths[row] = 0
        self._free_rows.append(row)
