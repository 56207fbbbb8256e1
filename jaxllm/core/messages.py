"""What crosses the engine-core boundary: core requests in, core outputs and stats out (vLLM's ``EngineCoreRequest``,
``EngineCoreOutput(s)``, ``SchedulerStats``).

Token ids and numbers only: no strings the user reads, no tokenizer, no ``RequestOutput`` (those are the front
end's: ``jaxllm.frontend.input_processor``, ``jaxllm.frontend.output_processor``). The same ``msgspec`` structs are handed over as
objects by the in-process client and as msgpack frames (``encode`` / ``decode_*``) by the multiprocess one, so
the in-process path pays no serialization. Structs are ``array_like`` (fields by position, no names on the wire)
and ``gc=False`` where they hold no cycles, which keeps building one per sequence per step cheap.

Times are seconds on ``time.monotonic`` (one clock for every process of a machine).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, Optional, Union

import ml_dtypes
import msgspec
import numpy as np

from scheduler.sampling_params import SamplingParams


class SampleLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One position's logprobs, as numbers (the front end turns them into vLLM's ``{token_id: Logprob}``).

    Attributes:
      token_id: the chosen (or prompt) token.
      logprob: its raw logprob (``log_softmax`` of the float32 logits).
      rank: its 1-based rank in that distribution.
      top_ids, top_logprobs: the top ``k`` tokens and their logprobs, descending.
    """

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, tag="add"):
    """A request as the core takes it: validated and tokenized by the front end.

    Attributes:
      request_id: unique among the front end's unfinished requests.
      prompt_token_ids: the prompt, within the vocabulary and ``max_model_len``.
      sampling_params: the request's (``n`` sequences are run).
      seeds: one random seed per sequence (``seed + i``, or drawn by the front end).
      stop_ids: ids banned until ``min_tokens``: the stop ids and every eos id.
      bad_words_token_ids: the bad words as token-id lists (both spellings, see
        ``input_processor.bad_words_token_ids``).
      eos_token_id: the primary eos id (None: no eos stop).
      arrival_time: when the front end received it.
      priority: lower is more urgent (``priority``/``aging`` policies).
      cache_salt: kept apart in the prefix cache from other salts.
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
    """What one step did to one sequence of a request.

    Attributes:
      request_id: the request's id.
      index: which of its ``n`` sequences.
      new_token_ids: tokens generated since the previous output.
      finish_reason: "stop", "length" or "abort" once finished, else None.
      stop_reason: the stop token id that ended it (stop strings are the front end's).
      new_logprobs: one entry per new token, when the request asked for logprobs.
      new_prompt_logprobs: prompt positions recorded since the request's previous
        output (one entry each, position 1 first), with ``prompt_logprobs``.
      num_cached_tokens: prompt tokens read from the prefix cache at first scheduling.
      first_scheduled_time: when the sequence was first scheduled (None before).
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
    """The core after a step (or after requests changed while it was idle), for metrics.

    Counters are cumulative since the core started; ``schedule_seconds`` and
    ``num_scheduled_tokens`` are None for an update without a step.

    Attributes:
      num_running, num_waiting: requests holding a batch seat, and waiting (held by static batching included).
      kv_cache_usage: fraction of non-null KV blocks referenced, in [0, 1].
      num_free_blocks, num_blocks: free KV blocks, and all of them (null block 0 included).
      kv_live_slots, kv_allocated_slots: token slots of referenced blocks that hold a computed token, and all.
      prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in, and served from, the prefix cache.
      num_preemptions: preemptions.
      compilations: programs the runner built (warm-up included).
      num_preempted_waiting: of the waiting requests, those preempted.
      max_num_seqs, max_num_batched_tokens: the limits in force (below the
        configured ones while graceful degradation backs off).
      prompt_len_cv: coefficient of variation (std / mean) of the running
        requests' prompt lengths; 0 with fewer than two running.
      schedule_seconds: host time of this step's ``schedule()``.
      num_scheduled_tokens: tokens computed in this step.
      spec_num_drafts: rows that verified draft tokens (speculative decoding).
      spec_num_draft_tokens, spec_num_accepted_tokens: draft tokens verified, and accepted.
      spec_accepted_per_position: accepted drafts by position in their row (0 = first draft).
      step_seconds: wall time of the whole step (schedule, batch, device, sample read-back).
      num_waiting_for_grammar: waiting requests whose structured-output grammar is still compiling.
      grammar_bitmask_seconds: host time of this step's structured-output bitmask (None: no constrained row).
      prefix_cache_hits_host: of ``prefix_cache_hits``, tokens loaded from the host tier (``kv_offloading_size``).
      kv_offload_bytes_to_host, kv_offload_bytes_to_device: bytes the host tier's copies moved each way (every
        runner's KV, a draft model's included).
      kv_offload_seconds_to_host, kv_offload_seconds_to_device: engine-loop time of those copies (to the host:
        dispatching the gathers before the step, writing the host pool after its dispatch, while it runs; to the
        device: the host side and the dispatch; the device finishes them before the step reads them).
      num_offload_blocks, num_offload_cached_blocks: the host tier's blocks, and those holding a block.
      num_predicted_finished, predicted_output_tokens, actual_output_tokens, prediction_abs_error_tokens: the
        output-length predictor's record (``scheduler.SchedulerStats``' fields of the names), cumulative.
      num_compressed_blocks, num_compressed_in_use, num_blocks_compressed: the compressed KV pool's slots, those
        held, and blocks compressed instead of a preemption, cumulative (``kv_cache_compression``; 0 without).
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
    num_compressed_blocks: int = 0
    num_compressed_in_use: int = 0
    num_blocks_compressed: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="outputs"):
    """One step's outputs of one core, with its stats after the step.

    Attributes:
      outputs: one per sequence that produced a token or finished.
      stats: the core's ``CoreStats``.
      core_index: which data-parallel core sent it.
    """

    outputs: list[EngineCoreOutput]
    stats: CoreStats
    core_index: int = 0


class CoreInfo(msgspec.Struct, array_like=True, tag="ready"):
    """What the front end needs to know of a core (its handshake in the multiprocess client).

    Attributes:
      vocab_size: the model's vocabulary.
      max_model_len: prompt + output tokens at most.
      eos_token_ids: the model's eos ids (config and generation config; the
        front end puts the tokenizer's first).
      num_blocks, block_size: the KV cache (blocks, null block included; tokens per block).
      max_num_seqs: sequences per step at most.
      max_banned_ids: multi-token bad words a sequence may have at most.
      enable_prefix_caching: whether the core reuses cached prompt blocks.
      device_ids: the ids of the devices the core's model step runs on.
      core_index: the core's data-parallel rank.
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
    """Call ``EngineCore.<method>(*args)`` between steps (``EngineCore.UTILITY_METHODS``); answered by ``UtilityResult``."""

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
    """``{path: leaf}`` of a parameter tree of nested dicts, a path being the keys joined by ``/``
    (``"layers/wq"``); a key that holds ``/`` is already a path.

    Raises:
      ValueError: ``tree`` is not a dict (named by its type).
    """
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
    """A parameter tree (host arrays, or anything ``np.asarray`` reads: device arrays are copied to the host) as
    msgpack-ready values for another process: ``{path: [dtype name, shape, raw bytes (C order)]}``
    (:func:`flatten`'s paths); the bytes are the arrays' own buffers where they are contiguous."""
    out = {}
    for path, leaf in flatten(tree).items():
        array = np.ascontiguousarray(leaf)
        out[path] = [array.dtype.name, list(array.shape), memoryview(array.reshape(-1).view(np.uint8))]
    return out


def decode_params(encoded: dict[str, list]) -> dict[str, np.ndarray]:
    """The arrays of :func:`encode_params` (read-only views of the received bytes, no copy).

    Raises:
      ValueError: a dtype numpy and ml_dtypes do not know, or bytes that do not fill the shape (the leaf named).
    """
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
