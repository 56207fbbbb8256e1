"""One interface for KV held off the device pool, and the typed block copies its tiers queue for the runner.

The scheduler calls its tiers at a few points only (vLLM's ``KVConnectorBase_V1`` is the same idea): at
admission (:meth:`KVTier.match`, :meth:`KVTier.resume`), at a shortage of free device blocks
(:meth:`KVTier.make_room` before a preemption, :meth:`KVTier.keep` at one), and once a step (the copies it
queued, :meth:`KVTier.take_copies`; those of a step that never ran, :meth:`KVTier.forget`). What settings a tier
cannot run with, it says itself (:meth:`KVTier.refuses`).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

if TYPE_CHECKING:
    from scheduler.request import Request


class CopyKind(enum.IntEnum):
    """What a ``BlockCopy`` does, and where it runs in its step: the runner does a step's copies in this order,
    all of them before the step's program.

    ``COMPRESS`` comes first: the device blocks it re-encodes are free again, and later copies or the step may
    write them. Device -> host copies come before host -> device ones, whose device blocks may be the ones the
    former just gave up. An ``OFFLOAD``'s host write may complete after the step is dispatched: no ``LOAD`` of the
    same step reads its slot. A ``COPY``'s source is a cached block that no ``SWAP_IN`` or ``LOAD`` of the step
    writes (the scheduler holds a reference on it until ``update_from_output``).
    """

    COMPRESS = 0  # (device block, compressed slot): a full block re-encoded into the compressed pool
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
    """The first ``(field, refused, reads)`` entry of ``table`` whose field ``config`` (a dataclass) has and
    ``refused(value)`` holds for, as ``reads`` formatted with ``"field=value"``; None when there is none."""
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for field, refused, reads in table:
        if field in settings and refused(settings[field]):
            return reads.format(f"{field}={settings[field]!r}")
    return None


@dataclasses.dataclass
class Admission:
    """What a tier's :meth:`KVTier.match` may weigh for one admission.

    Attributes:
      budget: the step's tokens left.
      may_wait: the step has rows already, so the request may wait a step without stalling the queue.
      chunk: the tokens ``chunk(remaining, budget)`` the scheduler would schedule for ``remaining`` tokens.
      copy_budget: the host-tier copies a step queues at most beyond its first loading request's.
    """

    budget: int
    may_wait: bool
    chunk: Callable[[int, int], int]
    copy_budget: int


class KVTier(abc.ABC):
    """A store of KV blocks beside the device pool. Every method but :meth:`take_copies` has a default that does
    nothing, for the points where a tier has no part.

    Attributes:
      makes_room: whether :meth:`make_room` can ever free device blocks (the scheduler only then works out the
        victim order it takes).
    """

    makes_room = False

    @classmethod
    def refuses(cls, config: Any) -> Optional[str]:
        """The first setting of ``config`` (a dataclass: ``SchedulerConfig`` or the engine's flat config, read by
        field name) this tier cannot run with, as ``"field=value (why)"``; None when it runs with all of them."""
        return None

    def match(self, request: "Request", hits: list, admission: Admission) -> Optional[tuple[list, int]]:
        """At admission: ``hits`` (the device's prefix hits) continued through this tier, and how many of the result
        are this tier's; None when ``request`` should wait a step instead."""
        return hits, 0

    def holds_request(self, request: "Request") -> bool:
        """Whether this tier holds ``request``'s KV whole (it comes back by :meth:`resume`, not by hits)."""
        return False

    def resume(self, request: "Request", num_new_tokens: int) -> bool:
        """At admission of a request this tier :meth:`holds_request`: bring its KV back with room for ``num_new_tokens``
        more tokens, queuing the copies; False, changing nothing, when the device blocks are short."""
        return False

    def make_room(self, need: int, victims: Sequence["Request"]) -> bool:
        """At a shortage, before a preemption: free ``need`` device blocks from ``victims`` (running requests, the
        one a preemption takes first, first), queuing the copies; False, changing nothing, when it cannot."""
        return False

    def reclaimable(self, running: Sequence["Request"]) -> int:
        """Device blocks :meth:`make_room` could free now from ``running``."""
        return 0

    def keep(self, request: "Request") -> bool:
        """At a preemption: keep ``request``'s KV here (its device blocks freed, the copies queued); False, changing
        nothing, when this tier does not take it."""
        return False

    @abc.abstractmethod
    def take_copies(self) -> list[BlockCopy]:
        """The copies queued since the last call, in the order queued."""

    def forget(self, copies: Sequence[BlockCopy], running: Sequence["Request"]) -> list["Request"]:
        """A step whose ``copies`` may never have run is discarded: forget what they were to fill. Returns the
        ``running`` requests whose KV they were to write (they start over)."""
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
