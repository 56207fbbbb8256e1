"""N-gram (prompt lookup) proposer, as vLLM's ``NgramProposer``: drafts copied from earlier in the sequence."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Up to ``num_speculative_tokens`` (>= 1) drafts per sequence by n-gram lookup, sizes
    ``prompt_lookup_max`` down to ``prompt_lookup_min``, from the latest earlier occurrence (vLLM: the first)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """Up to ``num_speculative_tokens`` ids to follow ``token_ids`` (prompt and outputs), possibly none."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        num = len(tokens)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. num - n - 1: each has a token after it, and none is the suffix itself.
            windows = sliding_window_view(tokens[: num - 1], n)
            starts = np.flatnonzero((windows == tokens[num - n:]).all(axis=1))
            if len(starts):
                start = int(starts[-1]) + n
                return tokens[start: start + self.k].tolist()
        return []
