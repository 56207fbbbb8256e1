"""What crosses the engine-core boundary (vLLM's ``EngineCoreRequest``, ``EngineCoreOutput(s)``, ``SchedulerStats``):
``msgspec`` structs, objects in-process and msgpack frames (``encode`` / ``decode_*``) across processes. Times are
seconds on ``time.monotonic``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, Optional, Union

import ml_dtypes
import msgspec
import numpy as np

from scheduler.sampling_params import SamplingParams


class SampleLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One position's logprobs as numbers: ``token_id``, its raw ``logprob`` and 1-based ``rank``, and the top
    ``k`` as ``top_ids``/``top_logprobs``, descending.
    """

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, tag="add"):
    """A request as the core takes it: validated and tokenized by the front end.

    Attributes:
      request_id: unique among unfinished requests. prompt_token_ids: within the vocabulary and ``max_model_len``.
      sampling_params: ``n`` sequences are run. seeds: one per sequence.
      stop_ids: ids banned until ``min_tokens`` (stop and eos ids). bad_words_token_ids: token-id lists.
      eos_token_id: the primary eos id (None: no eos stop). arrival_time: seconds.
      priority: lower is more urgent. cache_salt: kept apart in the prefix cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seeds: list[int]
    stop_ids: list[int]
    bad_words_token_ids: list[list[int]]
    eos_token_id: Optional[int]
    arrival_time: float
    priority: int = 0
    cache_salt: Optional[str] = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step did to one sequence (``index`` of ``n``) of a request.

    Attributes:
      new_token_ids: tokens since the previous output. finish_reason: "stop", "length", "abort" or None.
      stop_reason: the stop token id that ended it. new_logprobs: one per new token, when asked.
      new_prompt_logprobs: prompt positions recorded since the previous output (position 1 first).
      num_cached_tokens: prompt tokens from the prefix cache. first_scheduled_time: seconds, or None.
      ignored_reason: why the scheduler refused it, if it did.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    new_logprobs: Optional[list[SampleLogprobs]] = None
    new_prompt_logprobs: Optional[list[SampleLogprobs]] = None
    num_cached_tokens: int = 0
    first_scheduled_time: Optional[float] = None
    ignored_reason: Optional[str] = None


class CoreStats(msgspec.Struct, array_like=True, gc=False):
    """The core after a step (or an idle change), for metrics; counters are cumulative since the core started.

    Attributes:
      num_running, num_waiting: requests holding a batch seat, and waiting.
      kv_cache_usage: fraction of non-null KV blocks referenced, in [0, 1].
      num_free_blocks, num_blocks: free KV blocks, and all (null block included).
      kv_live_slots, kv_allocated_slots: token slots holding a computed token, and all allocated.
      prefix_cache_queries, prefix_cache_hits: prompt tokens looked up, and served.
      num_preemptions, compilations, num_preempted_waiting: counts.
      max_num_seqs, max_num_batched_tokens: the limits in force (lowered by graceful degradation).
      prompt_len_cv: std / mean of the running prompts' lengths (0 below two).
      schedule_seconds, num_scheduled_tokens: this step's ``schedule()`` time and tokens (None without a step).
      spec_num_drafts, spec_num_draft_tokens, spec_num_accepted_tokens, spec_accepted_per_position: drafts.
      step_seconds: wall time of the whole step.
      num_waiting_for_grammar, grammar_bitmask_seconds: structured output (None: no constrained row).
      prefix_cache_hits_host: hits loaded from the host tier.
      kv_offload_bytes_to_host/_to_device, kv_offload_seconds_to_host/_to_device: host-tier copies' bytes and
        engine-loop seconds. num_offload_blocks, num_offload_cached_blocks: host-tier blocks, and those in use.
      num_predicted_finished, predicted_output_tokens, actual_output_tokens, prediction_abs_error_tokens:
        the output-length predictor's record.
      num_pool_blocks, num_pool_in_use, num_blocks_pooled: the scheduler's pool tier (``SchedulerStats``; 0 without).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    kv_live_slots: int
    kv_allocated_slots: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    compilations: int
    num_preempted_waiting: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prompt_len_cv: float
    schedule_seconds: Optional[float] = None
    num_scheduled_tokens: Optional[int] = None
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    step_seconds: Optional[float] = None
    num_waiting_for_grammar: int = 0
    grammar_bitmask_seconds: Optional[float] = None
    prefix_cache_hits_host: int = 0
    kv_offload_bytes_to_host: int = 0
    kv_offload_bytes_to_device: int = 0
    kv_offload_seconds_to_host: float = 0.0
    kv_offload_seconds_to_device: float = 0.0
    num_offload_blocks: int = 0
    num_offload_cached_blocks: int = 0
    num_predicted_finished: int = 0
    predicted_output_tokens: int = 0
    actual_output_tokens: int = 0
    prediction_abs_error_tokens: int = 0
    num_pool_blocks: int = 0
    num_pool_in_use: int = 0
    num_blocks_pooled: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="outputs"):
    """One step's ``outputs`` of one core (``core_index``), with its ``stats`` after the step."""

    outputs: list[EngineCoreOutput]
    stats: CoreStats
    core_index: int = 0


class CoreInfo(msgspec.Struct, array_like=True, tag="ready"):
    """What the front end needs to know of a core (the multiprocess handshake).

    Attributes:
      vocab_size, max_model_len, eos_token_ids: the model's. num_blocks (null included), block_size: the KV
      cache. max_num_seqs, max_banned_ids: limits. enable_prefix_caching: bool. device_ids: the step's devices.
      core_index: the data-parallel rank.
    """

    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_banned_ids: int
    enable_prefix_caching: bool
    device_ids: list[int]
    core_index: int = 0


class AbortRequests(msgspec.Struct, array_like=True, tag="abort"):
    """Abort whole requests (all their sequences); their blocks are freed at once."""

    request_ids: list[str]


class StopSequences(msgspec.Struct, array_like=True, tag="stop"):
    """Finish sequences a stop string ended: ``(request_id, index)`` pairs."""

    sequences: list[tuple[str, int]]


class UtilityCall(msgspec.Struct, array_like=True, tag="call"):
    """Call ``EngineCore.<method>(*args)`` between steps; answered by ``UtilityResult``."""

    call_id: int
    method: str
    args: list[Any]


class UtilityResult(msgspec.Struct, array_like=True, tag="result"):
    """The value (or the error message, and the exception's class name) of a ``UtilityCall``."""

    call_id: int
    result: Any = None
    error: Optional[str] = None
    error_type: Optional[str] = None


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    """Stop the core process's loop (after aborting every request)."""


class CoreFailed(msgspec.Struct, array_like=True, tag="failed"):
    """The core process hit an error it cannot continue after; it exits next."""

    core_index: int
    message: str


def flatten(tree: Any) -> dict[str, Any]:
    """``{"a/b": leaf}`` of a nested-dict parameter tree. Raises ValueError: ``tree`` is not a dict."""
    if not isinstance(tree, Mapping):
        raise ValueError(f"params must be a dict of arrays (the layout of jaxllm.models.param_layout), "
                         f"not {type(tree).__name__}")
    return dict(_walk("", tree))


def _walk(prefix: str, node: Mapping) -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        if isinstance(value, Mapping):
            yield from _walk(f"{prefix}{key}/", value)
        else:
            yield f"{prefix}{key}", value


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The nested dicts of ``{path: leaf}`` (the inverse of :func:`flatten`)."""
    tree: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, key = path.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = leaf
    return tree


def encode_params(tree: Any) -> dict[str, list]:
    """A parameter tree as msgpack-ready ``{path: [dtype name, shape, raw C-order bytes]}`` (device arrays copied)."""
    out = {}
    for path, leaf in flatten(tree).items():
        array = np.ascontiguousarray(leaf)
        out[path] = [array.dtype.name, list(array.shape), memoryview(array.reshape(-1).view(np.uint8))]
    return out


def decode_params(encoded: dict[str, list]) -> dict[str, np.ndarray]:
    """The arrays of :func:`encode_params` (read-only views). Raises ValueError: unknown dtype or short bytes."""
    out = {}
    for path, (dtype_name, shape, data) in encoded.items():
        dtype = np.dtype(getattr(ml_dtypes, dtype_name, dtype_name))
        if len(data) != dtype.itemsize * int(np.prod(shape)):
            raise ValueError(f"params leaf {path!r}: {len(data)} bytes do not hold a {dtype_name} array of {shape}")
        out[path] = np.frombuffer(data, dtype).reshape(shape)
    return out


CoreInput = Union[EngineCoreRequest, AbortRequests, StopSequences, UtilityCall, Shutdown]
CoreMessage = Union[EngineCoreOutputs, CoreInfo, UtilityResult, CoreFailed]

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_message_decoder = msgspec.msgpack.Decoder(CoreMessage)


def encode(message: Union[CoreInput, CoreMessage]) -> bytes:
    """One message as a msgpack frame."""
    return _encoder.encode(message)


def decode_input(frame: bytes) -> CoreInput:
    """A frame the front end sent to a core."""
    return _input_decoder.decode(frame)


def decode_message(frame: bytes) -> CoreMessage:
    """A frame a core sent to the front end."""
    return _message_decoder.decode(frame)
