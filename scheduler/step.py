"""The mutable state of one ``Scheduler.schedule()`` call."""

from __future__ import annotations

import numpy as np

from scheduler.block_table import BlockTable
from scheduler.output import SchedulerOutput
from scheduler.persistent_batch import COMPUTED, LAST_SAMPLE_ROW, LAST_TOKEN, PENDING, PROMPT, TOKENS, PersistentBatch
from scheduler.request import Request

_NO_ROWS = np.zeros(0, dtype=np.intp)
_NO_ROWS.flags.writeable = False
_NO_COUNTS = np.zeros(0, dtype=np.int32)
_NO_COUNTS.flags.writeable = False


class Step:
    """Mutable state of one ``schedule()`` call, its rows in batch order: bulk rows as arrays (``bulk_*``), others
    one by one (``tail_*``); a row preempted later in the step is dropped."""

    __slots__ = (
        "budget", "preempted", "preempted_ids", "admitted_ids", "now", "dropped", "headroom",
        "bulk_requests", "bulk_rows", "bulk_new", "bulk_computed", "tail_requests", "tail_new", "tail_computed",
    )

    def __init__(self, budget: int, now: float) -> None:
        self.budget = budget
        self.preempted: list[Request] = []
        self.preempted_ids: set[str] = set()
        self.admitted_ids: set[str] = set()
        self.now = now
        self.dropped: set[str] = set()
        # With reserve_predicted_output: free blocks that the running requests' predicted outputs leave.
        self.headroom = 0
        self.bulk_requests: list[Request] = []
        self.bulk_rows, self.bulk_new, self.bulk_computed = _NO_ROWS, _NO_COUNTS, _NO_COUNTS
        self.tail_requests: list[Request] = []
        self.tail_new: list[int] = []
        self.tail_computed: list[int] = []

    def add(self, req: Request, num_new: int, num_computed: int) -> None:
        """Add a row for ``req``: ``num_new`` tokens after its ``num_computed``, taken from the budget."""
        self.tail_requests.append(req)
        self.tail_new.append(num_new)
        self.tail_computed.append(num_computed)
        self.budget -= num_new

    @property
    def num_rows(self) -> int:
        """Rows scheduled so far, those taken back by a preemption not counted."""
        return len(self.bulk_requests) + len(self.tail_requests) - len(self.dropped)

    def drop(self, req: Request) -> None:
        """Take back ``req``'s row, if it has one, and its tokens."""
        for requests, new in ((self.bulk_requests, self.bulk_new), (self.tail_requests, self.tail_new)):
            if req in requests:
                self.dropped.add(req.request_id)
                self.budget += int(new[requests.index(req)])
                return

    def emit(self, batch: PersistentBatch, table: BlockTable, block_size: int) -> SchedulerOutput:
        """The step's output, its rows advanced in ``batch`` (tables from ``table``), samples pending."""
        data = batch.data
        requests, rows, new, computed = self.bulk_requests, self.bulk_rows, self.bulk_new, self.bulk_computed
        if self.tail_requests:
            requests = requests + self.tail_requests
            rows = np.concatenate([rows, np.array([r.batch_row for r in self.tail_requests], np.intp)])
            new = np.concatenate([new, np.array(self.tail_new, np.int32)])
            computed = np.concatenate([computed, np.array(self.tail_computed, np.int32)])
        if self.dropped:
            keep = np.array([r.request_id not in self.dropped for r in requests], dtype=bool)
            requests = [r for r, k in zip(requests, keep.tolist()) if k]
            rows, new, computed = rows[keep], new[keep], computed[keep]
        # take() gathers whole rows several times faster than fancy indexing.
        state = data.take(rows, axis=0)
        known, pending = state[:, TOKENS], state[:, PENDING]
        advanced = computed + new
        samples = advanced >= known + pending
        sampled = samples.nonzero()[0]
        # Tokens past the known ones (and pending samples) are drafts.
        num_spec = np.maximum(advanced - known - pending, 0)
        num_blocks = table.lengths[rows]
        out = SchedulerOutput(
            requests=requests,
            num_new_tokens=new,
            num_computed_tokens=computed,
            samples=samples,
            sample_index=(known - state[:, PROMPT] + pending) * samples,
            prev_row=np.where(computed >= known, state[:, LAST_SAMPLE_ROW], -1) if pending.any() else pending - 1,
            num_spec_tokens=num_spec,
            batch_rows=rows,
            last_token_ids=state[:, LAST_TOKEN].copy(),
            num_blocks=num_blocks,
            block_tables=table.table[rows, : num_blocks.max(initial=0)],
            total_num_scheduled_tokens=int(new.sum()),
            preempted=self.preempted,
            block_size=block_size,
        )
        state[:, COMPUTED] = advanced
        state[sampled, PENDING] += 1
        state[sampled, LAST_SAMPLE_ROW] = sampled
        data[rows] = state
        for req, num in zip(requests, advanced.tolist()):
            req.num_computed_tokens = num
        return out
