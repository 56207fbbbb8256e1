"""SchedulerConfig validation and policy lookup."""

import re

import pytest

from scheduler import AgingPolicy, FCFSPolicy, Policy, Scheduler, SchedulerConfig, get_policy
from tests._scheduler_harness import FakeRunner, make_request, step


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_blocks=1), "num_blocks=1 is out of range: must be an int >= 2"),
        (dict(block_size=0), "block_size=0 is out of range: must be an int >= 1"),
        (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens=32 is out of range: must be an int >= max_num_seqs=64"),
        (dict(enable_chunked_prefill=False), "max_num_batched_tokens=512 is out of range: must be >= max_model_len=2048"),
        (dict(scheduling_policy="lifo"), "scheduling_policy='lifo' is out of range"),
        (dict(preemption_mode="drop"), "preemption_mode='drop' is out of range"),
        (dict(num_host_blocks=-1), "num_host_blocks=-1 is out of range"),
        (dict(aging_rate=-0.5), "aging_rate=-0.5 is out of range"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold=-1 is out of range"),
    ],
)
def test_config_rejects_out_of_range_values_naming_value_and_limit(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SchedulerConfig(**{"num_blocks": 16, **overrides})


def test_get_policy_builds_named_policies_and_passes_instances_through():
    mine = FCFSPolicy()
    assert get_policy(mine) is mine
    aging = get_policy("aging", aging_rate=0.25)
    assert isinstance(aging, AgingPolicy) and aging.aging_rate == 0.25


def test_get_policy_rejects_unknown_names():
    with pytest.raises(ValueError, match="scheduling_policy='lifo' is unknown"):
        get_policy("lifo")


def test_a_user_policy_orders_by_its_own_key():
    class NewestFirst(Policy):
        keys_change_over_time = False

        def key(self, request, now):
            return (-request.arrival_time, request._seq)

    config = SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=32,
                             scheduling_policy=NewestFirst())
    sched = Scheduler(config)
    sched.add_request(make_request("old", [1, 2], arrival_time=0.0))
    sched.add_request(make_request("new", [3, 4], arrival_time=5.0))
    out, _ = step(sched, FakeRunner(config))
    assert [r.request.request_id for r in out.scheduled] == ["new"]
