"""Static batching, the baseline continuous batching is measured against: ``Scheduler`` with its intake gated."""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Union

from scheduler import Request, RequestStatus, Scheduler, SchedulerOutput, SchedulerStats


class StaticBatchScheduler(Scheduler):
    """A ``Scheduler`` handing up to ``max_num_seqs`` held requests (arrival order) to itself only once the previous
    batch finished entirely; held requests count as waiting and unfinished, and aborting one drops it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: collections.deque[Request] = collections.deque()

    def add_request(self, request: Request) -> None:
        """Hold ``request`` until the next batch is formed."""
        self.held.append(request)

    def schedule(self) -> SchedulerOutput:
        """Form a new batch of up to ``max_num_seqs`` held requests if none is unfinished, then schedule."""
        if not self.requests:
            for _ in range(min(self.config.max_num_seqs, len(self.held))):
                super().add_request(self.held.popleft())
        return super().schedule()

    def finish_requests(self, request_ids: Union[str, Iterable[str]], status: RequestStatus) -> None:
        """As ``Scheduler.finish_requests``; held requests are dropped from the hold queue."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        super().finish_requests(ids, status)
        for request in [r for r in self.held if r.request_id in ids]:
            self.held.remove(request)
            request.status = status

    def has_unfinished_requests(self) -> bool:
        """True while a request is held, unfinished, or awaiting its finish report."""
        return bool(self.held) or super().has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        """Requests held, waiting, running or preempted."""
        return len(self.held) + super().num_unfinished_requests

    @property
    def stats(self) -> SchedulerStats:
        """``Scheduler.stats`` with held requests counted as waiting."""
        stats = super().stats
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + len(self.held))
