"""One interface for KV held off the device pool (the idea of vLLM's ``KVConnectorBase_V1``), and the typed block
copies its tiers queue for the runner."""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

if TYPE_CHECKING:
    from scheduler.request import Request


class CopyKind(enum.IntEnum):
    """What a ``BlockCopy`` does; the runner does a step's copies in this order, all before the step's program.

    ``ENCODE`` first (its device blocks are free again after it); device -> host before host -> device (whose
    destinations may be what the former gave up). No ``LOAD`` reads an ``OFFLOAD`` slot of its step (that write may
    complete after dispatch); no ``SWAP_IN`` or ``LOAD`` of the step writes a ``COPY``'s source.
    """

    ENCODE = 0  # (device block, pool slot): a full block re-encoded into a tier's scaled pool
    SWAP_OUT = 1  # (device block, host block): a swap-preempted request's KV
    OFFLOAD = 2  # (device block, host slot): a hashed block about to be reused, kept in the host tier
    SWAP_IN = 3  # (host block, device block): a swapped-out request's KV back
    LOAD = 4  # (host slot, device block): a host-tier prefix hit, into the fresh block taking its place
    COPY = 5  # (device block, device block): a fully cached prompt's last block copied on write, a fork's partial one


class BlockCopy(NamedTuple):
    """One block copy: ``src`` and ``dst`` are ids in the pools ``kind`` names."""

    kind: CopyKind
    src: int
    dst: int


def copies_of(kind: CopyKind, pairs: Sequence[tuple[int, int]]) -> list[BlockCopy]:
    """``pairs`` of ``(src, dst)`` as copies of ``kind``."""
    return [BlockCopy(kind, src, dst) for src, dst in pairs]


def first_refused(config: Any, table: Sequence[tuple[str, Callable[[Any], bool], str]]) -> Optional[str]:
    """The first ``(field, refused, reads)`` of ``table`` whose field ``config`` has and ``refused(value)`` holds
    for, as ``reads`` formatted with ``"field=value"``; else None."""
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for field, refused, reads in table:
        if field in settings and refused(settings[field]):
            return reads.format(f"{field}={settings[field]!r}")
    return None


@dataclasses.dataclass
class Admission:
    """What :meth:`KVTier.match` may weigh for one admission: budget (the step's tokens left), may_wait (the step has
    rows, so waiting a step stalls nothing), chunk (``chunk(remaining, budget)``, the tokens the scheduler would
    schedule), copy_budget (``Scheduler.copy_budget``)."""

    budget: int
    may_wait: bool
    chunk: Callable[[int, int], int]
    copy_budget: int


class KVTier(abc.ABC):
    """A store of KV blocks beside the device pool; every method but :meth:`take_copies` defaults to doing nothing.
    ``makes_room``: whether :meth:`make_room` can ever free device blocks."""

    makes_room = False

    @classmethod
    def refuses(cls, config: Any) -> Optional[str]:
        """The first setting of ``config`` (a dataclass read by field name) this tier cannot run with, as
        ``"field=value (why)"``; None when none."""
        return None

    def match(self, request: "Request", hits: list, admission: Admission) -> Optional[tuple[list, int]]:
        """At admission: ``hits`` (the device's prefix hits) continued through this tier, and how many of the result
        are this tier's; None when ``request`` should wait a step instead."""
        return hits, 0

    def holds_request(self, request: "Request") -> bool:
        """Whether this tier holds ``request``'s KV whole (it comes back by :meth:`resume`, not by hits)."""
        return False

    def resume(self, request: "Request", num_new_tokens: int) -> bool:
        """Bring back the KV of a request it :meth:`holds_request`, with room for ``num_new_tokens`` more, queuing
        the copies; False, changing nothing, when device blocks are short."""
        return False

    def make_room(self, need: int, victims: Sequence["Request"]) -> bool:
        """Before a preemption: free ``need`` device blocks from ``victims`` (first-preempted first), queuing the
        copies; False, changing nothing, when it cannot."""
        return False

    def reclaimable(self, running: Sequence["Request"]) -> int:
        """Device blocks :meth:`make_room` could free now from ``running``."""
        return 0

    def keep(self, request: "Request") -> bool:
        """At a preemption: keep ``request``'s KV here (device blocks freed, copies queued); False, changing
        nothing, if it does not take it."""
        return False

    @abc.abstractmethod
    def take_copies(self) -> list[BlockCopy]:
        """The copies queued since the last call, in the order queued."""

    def forget(self, copies: Sequence[BlockCopy], running: Sequence["Request"]) -> list["Request"]:
        """Forget what a discarded step's ``copies`` were to fill; returns the ``running`` requests whose KV they
        were to write (they start over)."""
        return []

    def refuses_compaction(self) -> Optional[str]:
        """Why the device pool's block ids may not move now (compaction, resizing); None when they may."""
        return None

    def start_step(self) -> None:
        """Called as ``Scheduler.schedule`` starts: the copies of the steps before it have run (or were forgotten)."""

    def end_step(self) -> None:
        """Called as ``Scheduler.schedule`` ends, its copies taken."""

    def stats(self) -> dict[str, int]:
        """This tier's ``SchedulerStats`` fields."""
        return {}
