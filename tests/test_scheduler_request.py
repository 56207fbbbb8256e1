"""Request and RequestStatus."""

import pytest

from scheduler import Request, RequestStatus, SamplingParams


def test_finish_reason_follows_vllm_for_every_final_status():
    req = Request("r", [1, 2], SamplingParams())
    reasons = {}
    for status in RequestStatus:
        req.status = status
        reasons[status] = req.finish_reason
    assert reasons == {
        RequestStatus.WAITING: None,
        RequestStatus.WAITING_FOR_FSM: None,
        RequestStatus.RUNNING: None,
        RequestStatus.PREEMPTED: None,
        RequestStatus.FINISHED_STOPPED: "stop",
        RequestStatus.FINISHED_LENGTH_CAPPED: "length",
        RequestStatus.FINISHED_ABORTED: "abort",
        RequestStatus.FINISHED_IGNORED: "length",
    }


def test_is_finished_holds_for_exactly_the_finished_statuses():
    finished = [s for s in RequestStatus if RequestStatus.is_finished(s)]
    assert finished == [
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_IGNORED,
    ]


def test_token_counts_cover_prompt_and_output():
    req = Request("r", [5, 6, 7], SamplingParams())
    req.append_output_token(9)
    assert (req.num_prompt_tokens, req.num_output_tokens, req.num_tokens) == (3, 1, 4)
    assert req.all_token_ids == [5, 6, 7, 9]


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        Request("r", [], SamplingParams())


def test_negative_token_id_is_rejected():
    with pytest.raises(ValueError, match="token id -3 is negative"):
        Request("r", [1, -3], SamplingParams())


def test_queue_time_is_first_admission_minus_arrival():
    req = Request("r", [1], SamplingParams(), arrival_time=10.0)
    assert req.queue_time is None
    req.first_scheduled_time = 12.5
    assert req.queue_time == 2.5
