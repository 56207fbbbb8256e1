"""N-gram (prompt lookup) proposer: drafts copied from earlier in the sequence itself.

Follows vLLM's ``NgramProposer`` (after Saxena's prompt lookup decoding): find an earlier occurrence of the
sequence's last ``n`` tokens, for ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, and propose the
tokens that followed it. Pure numpy on the host; it pays when outputs repeat their input (summaries that quote,
code edits, extraction) and costs one vectorised scan per sequence per step otherwise.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` drafts per sequence by n-gram lookup.

    Args:
      num_speculative_tokens: drafts per proposal at most, >= 1.
      prompt_lookup_min, prompt_lookup_max: n-gram sizes tried, longest
        first, 1 <= min <= max.

    Of several earlier occurrences of the matched n-gram the latest is used
    (recent text is the likeliest to be repeated); vLLM's proposer takes the
    first. A match whose continuation is shorter than
    ``num_speculative_tokens`` proposes what there is.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """Drafts to follow ``token_ids`` (a sequence's prompt and outputs), possibly none.

        Returns:
          up to ``num_speculative_tokens`` token ids.
        """
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
