"""The mutable state of one ``Scheduler.schedule()`` call."""

from __future__ import annotations

import numpy as np

from scheduler.request import Request

_NO_ROWS = np.zeros(0, dtype=np.intp)
_NO_ROWS.flags.writeable = False
_NO_COUNTS = np.zeros(0, dtype=np.int32)
_NO_COUNTS.flags.writeable = False


class Step:
    """Mutable state of one ``schedule()`` call, with its rows so far in batch order.

    Running requests that need nothing but tokens and blocks are added in
    bulk, as arrays (``bulk_*``); every other row is added one by one
    (``tail_*``). A row whose request is preempted later in the step is
    dropped.
    """

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
