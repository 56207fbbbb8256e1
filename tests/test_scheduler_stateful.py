"""Random arrivals, lengths, shared prefixes, resent prompts, aborts and clock jumps against a cache of a few blocks.

Caches go down to one usable block, and prompts are often whole blocks of one
shared token run, sent again and again, so fully cached block-aligned prompts
that need the whole cache come up (issue 11 item 4). Liveness, after every
step: while requests are unfinished, some request is scheduled or finishes.
After every rule: each block is free xor referenced, with ref_cnt equal to the
number of block tables holding it, and never held twice (see
``check_block_invariants``). Inside every step, between schedule() and
update_from_output(), the same holds counting the pins of copy sources, and
every copy-on-write copy is exact (see ``check_copies``). At the end: every request finished or was ignored
with a reason, every unaborted one generated exactly what a scheduler-free
reference generates (the fake runner samples from KV it reads back through the
block tables), and free blocks == total - 1. Runs under every policy and both
preemption modes, with and without ``reserve_predicted_output``, with and without a host tier for the prefix
cache: its slots held + free always add up (``check_host_tier``), a step's loads never read a slot
its deferred offloads write, every copy moves exactly its block's tokens (``check_tier_copies``), and after every
step each slot holds exactly its block's tokens. With a compressed KV pool (``num_pool_blocks``; the fake
runner's compression is lossless, so outputs must still be exact): its slots held + free add up, only requests that
may be compressed hold compressed blocks, and compaction and resizing are refused.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from scheduler import RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from scheduler.kv.tier import CopyKind
from tests._scheduler_harness import (
    VOCAB,
    FakeClock,
    FakeRunner,
    check_block_invariants,
    check_copies,
    make_request,
    reference_output,
)

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
PREFIXES = ([], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9])
# Block-aligned prompts are leading whole blocks of this run, so they share prefix blocks.
ALIGNED = [1 + (i * 7) % (VOCAB - 1) for i in range(MAX_MODEL_LEN)]
EOS = 0
# max_tokens 1 often: a whole-block prompt then needs no block beyond its own.
SHORT_MAX_TOKENS = st.one_of(st.just(1), st.integers(1, 12))


class SchedulerMachine(RuleBasedStateMachine):
    policy = "fcfs"
    mode = "recompute"
    # True: always a host tier and one seat (otherwise drawn, and mostly absent).
    one_seat_tier = False
    compression = False

    @initialize(
        num_blocks=st.integers(2, 12),
        caching=st.booleans(),
        chunked=st.booleans(),
        threshold=st.sampled_from([0, 5]),
        reserve=st.booleans(),
        offload=st.sampled_from([0, 3, 8]),
        compressed=st.sampled_from([2, 3, 8]),
    )
    def setup(self, num_blocks, caching, chunked, threshold, reserve=False, offload=0, compressed=0):
        if self.one_seat_tier:
            # One seat, so requests wait beside free blocks while their hits sit in the host tier.
            caching, offload, num_blocks = True, max(offload, 3), max(num_blocks, 9)
        if self.compression:
            offload = 0
        self.config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_num_seqs=1 if self.one_seat_tier else 3,
            max_num_batched_tokens=10 if chunked else MAX_MODEL_LEN,
            max_model_len=MAX_MODEL_LEN,
            enable_prefix_caching=caching,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=threshold,
            scheduling_policy=self.policy,
            preemption_mode=self.mode,
            num_host_blocks=6,
            num_offload_blocks=offload if caching else 0,
            aging_rate=0.5,
            reserve_predicted_output=reserve,
            num_pool_blocks=compressed if self.compression else 0,
        )
        self.clock = FakeClock()
        self.sched = Scheduler(self.config, clock=self.clock)
        self.runner = FakeRunner(self.config)
        self.requests = []
        self.aborted = set()
        self.copies = 0
        self.broken = False

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        suffix=st.lists(st.integers(1, VOCAB - 1), max_size=28),
        max_tokens=st.integers(1, 12),
        min_tokens=st.integers(0, 2),
        priority=st.integers(-1, 3),
        use_eos=st.booleans(),
        opt_out=st.booleans(),
    )
    def add_request(self, prefix, suffix, max_tokens, min_tokens, priority, use_eos, opt_out=False):
        self._send((PREFIXES[prefix] + suffix) or [1], max_tokens, min_tokens, priority, use_eos, opt_out)

    @rule(
        num_blocks=st.one_of(st.none(), st.integers(1, MAX_MODEL_LEN // BLOCK_SIZE)),
        max_tokens=SHORT_MAX_TOKENS,
        priority=st.integers(0, 3),
    )
    def add_block_aligned_request(self, num_blocks, max_tokens, priority):
        """``num_blocks`` None: as many blocks as the whole cache holds (with max_tokens 1, it then needs all of it)."""
        if num_blocks is None:
            num_blocks = min(self.config.num_blocks - 1, MAX_MODEL_LEN // BLOCK_SIZE)
        self._send(ALIGNED[: num_blocks * BLOCK_SIZE], max_tokens, 0, priority, False)

    @rule(data=st.data(), max_tokens=SHORT_MAX_TOKENS, priority=st.integers(0, 3))
    def resend_a_prompt(self, data, max_tokens, priority):
        if self.requests:
            prompt = data.draw(st.sampled_from([r.prompt_token_ids for r in self.requests]))
            self._send(prompt, max_tokens, 0, priority, False)

    def _send(self, prompt, max_tokens, min_tokens, priority, use_eos, opt_out=False):
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), temperature=0,
                                allow_kv_compression=not opt_out)
        req = make_request(
            f"r{len(self.requests)}", prompt, params=params, priority=priority,
            eos_token_id=EOS if use_eos else None, arrival_time=self.clock.t,
        )
        self.sched.add_request(req)
        self.requests.append(req)
        kv_tokens = min(len(prompt) + max_tokens, max(MAX_MODEL_LEN, len(prompt) + 1)) - 1
        never_fits = len(prompt) > MAX_MODEL_LEN or -(-kv_tokens // BLOCK_SIZE) > self.config.num_blocks - 1
        assert (req.status == RequestStatus.FINISHED_IGNORED) == never_fits
        assert bool(req.ignored_reason) == never_fits

    @rule()
    def step(self):
        unfinished = len(self.sched.requests)
        out = self.sched.schedule()
        self.broken = True  # until update_from_output, so a failing check does not make teardown step again
        # Liveness: a request whose admission cannot succeed must never stall the queue.
        assert out.num_seqs or len(self.sched.requests) < unfinished or not unfinished, (
            f"{unfinished} unfinished requests but none scheduled or finished: "
            f"waiting {self.sched.waiting}, running {self.sched.running}"
        )
        check_block_invariants(self.sched)
        check_copies(self.sched, out)
        self.check_tier_copies(out)
        self.check_compressed_holders()
        self.copies += len(out.copies(CopyKind.COPY))
        updated = self.sched.update_from_output(out, self.runner(out))
        self.check_host_tier_contents()
        self.broken = False
        assert not self.sched.kv_cache_manager.copy_sources
        assert len({id(r) for r in updated}) == len(updated)
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens

    def _block_tokens(self):
        tokens = {}
        for req in self.requests:
            for i, h in enumerate(req.block_hashes):
                tokens[h] = req.all_token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        return tokens

    def check_compressed_holders(self):
        """Only requests that may be compressed hold compressed blocks."""
        kv = self.sched.kv_cache_manager
        cpool = kv.scaled_pool
        if cpool is None:
            return
        for rid, blocks in kv.req_to_blocks.items():
            if any(cpool.holds(b) for b in blocks):
                req = self.sched.requests[rid]
                assert req.sampling_params.allow_kv_compression and req.priority >= 0, req

    def check_host_tier_contents(self):
        """Once a step's copies are done, each host-tier slot holds exactly the tokens of its block hash."""
        tier = self.sched.block_pool.host_tier
        if tier is None:
            return
        tokens = self._block_tokens()
        for h, slot in tier.slots.items():
            assert self.runner.host[slot].tolist() == tokens[h]

    def check_tier_copies(self, out):
        """Before a step's copies (deferred offloads included): no load reads a slot this step's
        offloads write, each load's slot already holds exactly its block's tokens, and each offloaded device
        block holds exactly the tokens of the hash its slot now holds."""
        tier = self.sched.block_pool.host_tier
        if tier is None:
            assert not out.copies(CopyKind.OFFLOAD) and not out.copies(CopyKind.LOAD)
            return
        written = {slot for _, slot in out.copies(CopyKind.OFFLOAD)}
        assert written.isdisjoint(slot for slot, _ in out.copies(CopyKind.LOAD))
        tokens, by_slot = self._block_tokens(), {slot: h for h, slot in tier.slots.items()}
        bs, kv = BLOCK_SIZE, self.runner.kv
        for slot, block in out.copies(CopyKind.LOAD):
            assert self.runner.host[slot].tolist() == tokens[self.sched.block_pool.blocks[block].block_hash]
        for block, slot in out.copies(CopyKind.OFFLOAD):
            assert kv[block * bs:(block + 1) * bs].tolist() == tokens[by_slot[slot]]

    @rule(data=st.data())
    def abort(self, data):
        live = sorted(self.sched.requests)
        if live:
            rid = data.draw(st.sampled_from(live))
            self.sched.abort_request(rid)
            self.aborted.add(rid)

    @rule()
    def compact(self):
        """Compaction between steps: every referenced and cached block below the rest, KV moved with it (the
        teardown's outputs check that nothing read moved KV wrongly)."""
        pool = self.sched.block_pool
        if self.compression:
            with pytest.raises(ValueError, match="num_pool_blocks"):
                self.sched.compact_kv_cache()
            return
        live = {id(b) for b in pool.blocks if b.ref_cnt or b.block_hash is not None}
        moves = self.sched.compact_kv_cache()
        self.runner.relocate(moves)
        assert {id(b) for b in pool.blocks[1:len(live) + 1]} == live
        assert len({d for _, d in moves}) == len(moves) and not {d for _, d in moves} & {s for s, _ in moves}

    @rule(data=st.data())
    def abort_then_compact(self, data):
        """An abort leaves holes (its unhashed blocks) below other requests' blocks: compaction then moves some."""
        self.abort(data)
        self.compact()

    @rule(num_blocks=st.integers(1, 14))
    def resize(self, num_blocks):
        """A resize to any size: accepted ones keep every request going; refused ones change nothing."""
        pool = self.sched.block_pool
        before = (pool.num_blocks, pool.num_free_blocks, dict(self.sched.kv_cache_manager.req_to_block_ids))
        try:
            moves = self.sched.resize_kv_cache(num_blocks)
        except ValueError as e:
            assert str(num_blocks) in str(e)
            assert (pool.num_blocks, pool.num_free_blocks, dict(self.sched.kv_cache_manager.req_to_block_ids)) == before
            return
        self.runner.relocate(moves)
        self.runner.resize(num_blocks)
        self.config = self.sched.config
        assert pool.num_blocks == self.config.num_blocks == num_blocks

    @rule(dt=st.floats(0.0, 5.0))
    def advance_clock(self, dt):
        self.clock.advance(dt)

    @invariant()
    def blocks_are_consistent(self):
        if hasattr(self, "sched"):
            check_block_invariants(self.sched)

    def teardown(self):
        if not hasattr(self, "sched") or self.broken:
            return
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
            check_block_invariants(self.sched)
        assert not self.sched.has_unfinished_requests()
        for req in self.requests:
            assert req.is_finished, req
            if req.status == RequestStatus.FINISHED_IGNORED:
                assert req.ignored_reason
            elif req.request_id not in self.aborted:
                assert req.output_token_ids == reference_output(
                    req.prompt_token_ids, req.sampling_params, req.eos_token_id, MAX_MODEL_LEN
                ), req
        assert self.sched.block_pool.num_free_blocks == self.config.num_blocks - 1
        assert self.sched.kv_cache_manager.swap.host_pool.num_free_blocks == 6
        cpool = self.sched.kv_cache_manager.scaled_pool
        assert cpool is None or cpool.num_free_blocks == cpool.num_blocks - 1


def _test_case(policy, mode, one_seat_tier=False, compression=False):
    suffix = ("_one_seat_tier" if one_seat_tier else "") + ("_compression" if compression else "")
    machine = type(f"SchedulerMachine_{policy}_{mode}{suffix}", (SchedulerMachine,),
                   {"policy": policy, "mode": mode, "one_seat_tier": one_seat_tier, "compression": compression})
    case = machine.TestCase
    case.settings = settings(
        max_examples=25, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    return case


TestStatefulFCFSRecompute = _test_case("fcfs", "recompute")
TestStatefulFCFSSwap = _test_case("fcfs", "swap")
TestStatefulPriorityRecompute = _test_case("priority", "recompute")
TestStatefulPrioritySwap = _test_case("priority", "swap")
TestStatefulSJFRecompute = _test_case("sjf", "recompute")
TestStatefulSJFSwap = _test_case("sjf", "swap")
TestStatefulAgingRecompute = _test_case("aging", "recompute")
TestStatefulAgingSwap = _test_case("aging", "swap")
TestStatefulPredictedRecompute = _test_case("predicted", "recompute")
TestStatefulPredictedSwap = _test_case("predicted", "swap")
TestStatefulFCFSRecomputeOneSeatTier = _test_case("fcfs", "recompute", one_seat_tier=True)
TestStatefulPrioritySwapOneSeatTier = _test_case("priority", "swap", one_seat_tier=True)
TestStatefulFCFSCompression = _test_case("fcfs", "recompute", compression=True)
TestStatefulPriorityCompression = _test_case("priority", "recompute", compression=True)


def test_a_request_whose_hits_stop_at_a_block_being_written_is_admitted_when_the_step_has_no_other_row():
    """The machine's falsifying example (priority, swap, one seat with a host tier): r0's chunk takes a cached free block, whose
    hash is next in r2's chain and goes to the host tier; r2 then preempts r0, so the step has no row left and
    r2 must not wait for that write."""
    machine = type("Machine", (SchedulerMachine,), {"policy": "priority", "mode": "swap", "one_seat_tier": True})()
    machine.setup(num_blocks=2, caching=False, chunked=True, threshold=0)
    machine.add_block_aligned_request(max_tokens=1, num_blocks=None, priority=1)
    machine.step()
    machine.add_block_aligned_request(max_tokens=1, num_blocks=1, priority=0)
    machine.step()
    machine.step()
    machine.add_block_aligned_request(max_tokens=1, num_blocks=None, priority=0)
    machine.step()
    assert [r.request_id for r in machine.sched.running] == ["r2"] and machine.sched.num_preemptions == 2
    machine.teardown()
