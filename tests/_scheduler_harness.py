"""Test helpers: a fake clock, a fake model runner with a simulated KV cache, and invariant checks."""

from __future__ import annotations

from collections import Counter
from typing import Optional

import numpy as np
import xxhash

import scheduler.persistent_batch as pb
from scheduler.block_moves import order_block_moves
from scheduler.kv.tier import CopyKind
from scheduler import (
    BucketTable,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    build_batch,
)

VOCAB = 50


def next_token(history) -> int:
    """Deterministic fake model: a hash of the whole token history, mod VOCAB."""
    return xxhash.xxh3_64_intdigest(np.asarray(history, dtype=np.int64).tobytes()) % VOCAB


def reference_output(prompt: list[int], params: SamplingParams, eos: Optional[int], max_model_len: int) -> list[int]:
    """What a request must generate, computed without any scheduler (same stop rules)."""
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if len(out) >= params.min_tokens and ((t == eos and not params.ignore_eos) or t in params.stop_token_ids):
            return out
        if (params.max_tokens is not None and len(out) >= params.max_tokens) or len(tokens) >= max_model_len:
            return out


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakeRunner:
    """Plays the model runner: does the compressions, swap and copy-on-write copies, writes token ids into a
    simulated KV cache through slot_mapping, and samples from the history it *reads back* through the block
    tables -- so a wrong block table, slot, compression or prefix-cache hit changes the generated tokens. The
    compressed pool (lossless here) follows the cache in one id space, as the attention ops read it."""

    def __init__(self, config: SchedulerConfig, buckets: Optional[BucketTable] = None) -> None:
        bs = config.block_size
        self.block_size = bs
        self.kv = np.full(config.num_blocks * bs, -1, dtype=np.int64)
        # The swap pool's blocks, then the host tier's (as the model runner's host pool).
        self.host = np.full((max(config.num_host_blocks + config.num_offload_blocks, 1), bs), -1, dtype=np.int64)
        self.compressed = np.full(config.num_pool_blocks * bs, -1, dtype=np.int64)
        self.buckets = buckets or BucketTable.from_limits(
            config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len, bs, min_tokens=1, min_seqs=1, min_width=1
        )
        self.last_batch = None
        self.last_sampled: list[int] = []

    def __call__(self, output) -> list[int]:
        b = build_batch(output, self.buckets)
        self.last_batch = b
        # Async scheduling: inputs still "on the device" are the previous call's samples.
        fed = b.prev_token_index >= 0
        if fed.any():
            b.input_ids[fed] = np.asarray(self.last_sampled)[b.prev_token_index[fed]]
        bs = self.block_size
        # As the engine does: offloads are gathered before the step and written to the host after it, so a
        # load of a slot an offload of the same step writes would read the slot's old contents.
        offloaded = []
        for kind, src, dst in output.block_copies:
            if kind is CopyKind.ENCODE:
                self.compressed[dst * bs : (dst + 1) * bs] = self.kv[src * bs : (src + 1) * bs]
            elif kind is CopyKind.SWAP_OUT:
                self.host[dst] = self.kv[src * bs : (src + 1) * bs]
            elif kind is CopyKind.OFFLOAD:
                offloaded.append((dst, self.kv[src * bs : (src + 1) * bs].copy()))
            elif kind is CopyKind.COPY:
                self.kv[dst * bs : (dst + 1) * bs] = self.kv[src * bs : (src + 1) * bs]
            else:
                self.kv[dst * bs : (dst + 1) * bs] = self.host[src]
        self.kv[b.slot_mapping] = b.input_ids
        sampled = []
        for s in range(b.num_seqs):
            pos = np.arange(b.seq_lens[s])
            slots = b.block_tables[s, pos // bs] * bs + pos % bs
            sampled.append(next_token(self.read(slots)))
        for h, block in offloaded:
            self.host[h] = block
        self.last_sampled = sampled
        return sampled

    def read(self, slots: np.ndarray) -> np.ndarray:
        """The tokens at ``slots`` of the cache, and past its end of the compressed pool."""
        return np.concatenate([self.kv, self.compressed])[slots]

    def relocate(self, moves) -> None:
        """Do a compaction's ``(src, dst)`` moves round by round (``order_block_moves``), each round reading all
        its sources before writing, as the device's copy program does."""
        bs = self.block_size
        for moves_round in order_block_moves(moves):
            src, dst = (np.asarray(ids, np.int64) for ids in zip(*moves_round))
            slots = np.arange(bs)
            self.kv[(dst[:, None] * bs + slots).ravel()] = self.kv[(src[:, None] * bs + slots).ravel()]

    def resize(self, num_blocks: int) -> None:
        """The simulated cache cut or grown to ``num_blocks`` blocks (new ones empty)."""
        kv = np.full(num_blocks * self.block_size, -1, dtype=np.int64)
        n = min(len(kv), len(self.kv))
        kv[:n] = self.kv[:n]
        self.kv = kv


class FakeSpecRunner(FakeRunner):
    """A ``FakeRunner`` that verifies draft tokens greedily (speculative decoding): at each of a row's last
    ``num_spec_tokens + 1`` positions it samples from the KV read back up to there, and keeps the drafts while
    they equal those samples. Returns ``(tokens [num_seqs, 1 + max drafts], tokens per row)``."""

    def __call__(self, output) -> tuple[np.ndarray, np.ndarray]:
        super().__call__(output)
        b, bs = self.last_batch, self.block_size
        tokens = np.zeros((b.num_seqs, 1 + int(b.num_spec_tokens.max(initial=0))), np.int64)
        counts = np.ones(b.num_seqs, np.int64)
        for s in range(b.num_seqs):
            k, end, first = int(b.num_spec_tokens[s]), int(b.seq_lens[s]), int(b.logits_indices[s] - b.num_spec_tokens[s])
            for j in range(k + 1):
                pos = np.arange(end - k + j)
                tokens[s, j] = next_token(self.read(b.block_tables[s, pos // bs] * bs + pos % bs))
                if j == k or b.input_ids[first + j + 1] != tokens[s, j]:
                    counts[s] = j + 1
                    break
        return tokens, counts


def step(sched: Scheduler, runner: FakeRunner):
    """One schedule -> fake model -> update round; returns (output, updated requests)."""
    out = sched.schedule()
    return out, sched.update_from_output(out, runner(out))


def run_until_done(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000, check=None) -> int:
    """Step until nothing is unfinished; returns the number of steps. Fails past ``max_steps``."""
    for n in range(max_steps):
        if not sched.has_unfinished_requests():
            return n
        step(sched, runner)
        if check is not None:
            check(sched)
    raise AssertionError(f"scheduler still has {sched.num_unfinished_requests} unfinished requests after {max_steps} steps")


def run_async_until_done(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000, check=None) -> int:
    """As :func:`run_until_done` under ``async_scheduling``, in the engine's order: schedule and run step N+1,
    then apply step N's samples (a step without rows, after doing its copies, at once)."""
    in_flight = None
    for n in range(max_steps):
        if not sched.has_unfinished_requests() and in_flight is None:
            return n
        out = sched.schedule()
        sampled = runner(out)
        launched = (out, sampled) if out.num_seqs else None
        done = [in_flight] if in_flight is not None else []
        in_flight = launched
        if launched is None:
            done.append((out, []))
        for o, sampled in done:
            sched.update_from_output(o, sampled)
        if check is not None:
            check(sched)
    raise AssertionError(f"scheduler still has {sched.num_unfinished_requests} unfinished requests after {max_steps} steps")


def make_request(rid: str, prompt, max_tokens: Optional[int] = 8, **kw) -> Request:
    params = kw.pop("params", None) or SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(rid, list(prompt), params, **kw)


def check_block_invariants(sched: Scheduler) -> None:
    """Every non-null block is free xor referenced, with ref_cnt == number of tables holding it
    plus the pins of pending copies' sources; the same of the compressed pool's blocks, whose free and held
    slots add up to all of them."""
    pool, kv = sched.block_pool, sched.kv_cache_manager
    holders = Counter(b.block_id for b in kv.copy_sources + sched.kv_cache_manager.pinned_blocks)
    for rid, blocks in kv.req_to_blocks.items():
        assert len({b.block_id for b in blocks}) == len(blocks), f"{rid} holds a block twice"
        assert [b.block_id for b in blocks] == kv.req_to_block_ids[rid]
        holders.update(b.block_id for b in blocks)
    check_compressed_pool(kv.scaled_pool, holders)
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    assert 0 not in holders and 0 not in free_ids
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], block
        assert (block.ref_cnt == 0) == (block.block_id in set(free_ids)), block
        assert block.block_hash is None or pool.cached.get(block.block_hash) is block, f"{block} is not the map's"
    table, lengths = kv.block_table.table, kv.block_table.lengths
    rows = [sched.requests[rid].batch_row for rid in kv.req_to_block_ids]
    assert len(set(rows)) == len(rows) and min(rows, default=0) >= 0, "two requests share a batch row"
    for (rid, ids), r in zip(kv.req_to_block_ids.items(), rows):
        row = table[r]
        assert row[: len(ids)].tolist() == ids and not row[len(ids) :].any(), f"{rid}'s numpy block table row is stale"
        assert lengths[r] == len(ids)
    check_persistent_batch(sched)
    for h, block in pool.cached.items():
        assert block.block_hash == h
    assert set(kv.req_to_blocks) <= {r.request_id for r in sched.running} | set(sched.requests)
    for req in sched.waiting:
        assert req.request_id not in kv.req_to_blocks, f"waiting {req.request_id} holds device blocks"
    assert len(pool.blocks) == pool.num_blocks and all(b.block_id == i for i, b in enumerate(pool.blocks))
    host_ids = [h for ids in kv.swap.swapped.values() for h in ids]
    assert len(host_ids) == len(set(host_ids))
    assert len(host_ids) + kv.swap.host_pool.num_free_blocks == kv.swap.host_pool.num_host_blocks
    assert len(sched.running) <= sched.config.max_num_seqs
    check_host_tier(sched)


def check_compressed_pool(cpool, holders: Counter) -> None:
    """Each compressed block's ref_cnt is the tables holding it; held + free == all; none has a hash."""
    if cpool is None:
        return
    held = [b for b in cpool.blocks[1:] if b.ref_cnt]
    assert len(held) + cpool.num_free_blocks == cpool.num_blocks - 1
    assert holders[cpool.base] == 0 and cpool.blocks[0].ref_cnt == 0
    for block in cpool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id] and block.block_hash is None, block


def check_host_tier(sched: Scheduler) -> None:
    """The host tier's slots: each held by at most one hash, held + free == all, all in its id range, those being
    written held."""
    tier = sched.block_pool.host_tier
    if tier is None:
        return
    held = list(tier.slots.values())
    assert len(set(held)) == len(held), "a host slot holds two hashes"
    assert len(held) + tier.num_free_slots == tier.num_slots
    assert tier._writing <= set(held), "a slot being written holds no hash"
    assert all(tier.base <= s < tier.base + tier.num_slots for s in held)


def check_persistent_batch(sched: Scheduler) -> None:
    """Each running request's persistent batch row agrees with the request."""
    for req in sched.running:
        row = sched.batch.data[req.batch_row]
        assert (row[pb.COMPUTED], row[pb.TOKENS], row[pb.PROMPT], row[pb.LAST_TOKEN]) == (
            req.num_computed_tokens, req.num_tokens, req.num_prompt_tokens, req.all_token_ids[-1]
        ), f"{req.request_id}'s persistent batch row is stale"
        assert (row[pb.LENGTH_LIMIT], row[pb.PREFILL_ONLY], row[pb.SPEC]) == (
            req.length_limit, req.prefill_only, len(req.spec_token_ids)
        )


def check_copies(sched: Scheduler, out) -> None:
    """Between schedule() and update_from_output(): each copy goes from the canonical cached block
    of a row's last block hash to a fresh, unhashed block that only that row's table holds, in
    that last place, and the row computes exactly its last token; no other copy or swap-in
    writes the destination or the source."""
    pool, kv, bs = sched.block_pool, sched.kv_cache_manager, sched.config.block_size
    rows = {r.block_ids[-1]: r for r in out.scheduled if r.block_ids}
    dsts = [d for _, d in out.copies(CopyKind.COPY)]
    assert len(set(dsts)) == len(dsts)
    swapped_in = {d for _, d in out.copies(CopyKind.SWAP_IN)}
    assert sorted(b.block_id for b in kv.copy_sources) == sorted(s for s, _ in out.copies(CopyKind.COPY))
    for src, dst in out.copies(CopyKind.COPY):
        source, fresh, row = pool.blocks[src], pool.blocks[dst], rows[dst]
        req = row.request
        assert pool.cached[source.block_hash] is source
        assert source.block_hash == req.block_hashes[len(row.block_ids) - 1]
        assert (fresh.block_hash, fresh.ref_cnt) == (None, 1)
        assert src not in row.block_ids and src not in swapped_in and dst not in swapped_in
        assert (row.num_computed_tokens, row.num_new_tokens) == (req.num_tokens - 1, 1)
        assert req.num_tokens == len(row.block_ids) * bs


FINAL = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_IGNORED,
)
