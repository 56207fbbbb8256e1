"""Per-request numbers of the running requests, as numpy rows updated in place (vLLM v1's persistent batch)."""

from __future__ import annotations

import numpy as np

from scheduler.request import Request

# Columns of PersistentBatch.data.
COMPUTED = 0  # Request.num_computed_tokens
TOKENS = 1  # known tokens: prompt plus outputs received
PROMPT = 2  # prompt tokens
PENDING = 3  # samples scheduled but not yet received (async scheduling; else 0 or 1)
LAST_SAMPLE_ROW = 4  # row, in the latest SchedulerOutput, of the latest pending sample; -1 when none
LAST_TOKEN = 5  # the last known token id (a decode row's input)
LENGTH_LIMIT = 6  # Request.length_limit
EOS = 7  # the eos id that stops it; -1 for none (or ignore_eos)
HAS_STOP_IDS = 8  # 1 if it has stop_token_ids
PREFILL_ONLY = 9  # Request.prefill_only
SPEC = 10  # len(Request.spec_token_ids): draft tokens to verify at its next decode
NUM_COLUMNS = 11


class PersistentBatch:
    """One row per request holding KV blocks (``Request.batch_row``), vLLM v1's ``InputBatch``: numbers written at
    admission and updated in place; the scheduler also keeps them on the ``Request``.

    ``data``: int32[rows, NUM_COLUMNS], columns named by this module's constants; rows double on demand.
    """

    def __init__(self, rows: int = 8) -> None:
        self.data = np.zeros((max(rows, 1), NUM_COLUMNS), dtype=np.int32)

    def load(self, request: Request) -> None:
        """Write ``request``'s row (``request.batch_row``, which must be set) from the request, nothing pending."""
        row = request.batch_row
        if row >= len(self.data):
            grown = np.zeros((max(2 * len(self.data), row + 1), NUM_COLUMNS), dtype=np.int32)
            grown[: len(self.data)] = self.data
            self.data = grown
        sp = request.sampling_params
        eos = -1 if request.eos_token_id is None or sp.ignore_eos else request.eos_token_id
        self.data[row] = (
            request.num_computed_tokens, request.num_tokens, request.num_prompt_tokens, 0, -1,
            request.all_token_ids[-1], request.length_limit, eos, bool(sp.stop_token_ids), request.prefill_only,
            len(request.spec_token_ids),
        )
