"""Beam search over the engine (vLLM's ``LLM.beam_search``): each step asks the engine for one token of every live
beam, with the top ``2 * beam_width`` logprobs, as a request whose prompt is the beam so far (the prefix cache
makes that prompt cost its one new token); each instance keeps the ``beam_width`` best extensions by length-
normalized cumulative logprob, and a beam that draws an eos id is complete. The ranking follows vLLM's, which
follows Transformers'.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from jaxllm.outputs import Logprob, RequestOutput
from scheduler import SamplingParams
from scheduler.sampling_params import MAX_LOGPROBS


@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``.

    Attributes:
      beam_width: beams kept per prompt, and sequences returned; 1 to ``MAX_LOGPROBS // 2`` (each step reads the
        top ``2 * beam_width`` logprobs).
      max_tokens: tokens generated at most.
      ignore_eos: an eos id does not complete a beam.
      temperature: the engine's sampling temperature (the ranking reads raw logprobs, so it changes nothing).
      length_penalty: a beam's score is its cumulative logprob over (generated tokens, eos included) to this
        power; above 0 favours longer beams.
      include_stop_str_in_output: vLLM's field; a beam keeps its eos token either way.
      skip_special_tokens: leave special tokens out of ``text``.
      structured_outputs, allowed_token_ids, watermarking: vLLM's fields; only None is served here.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None
    skip_special_tokens: bool = True
    watermarking: Optional[bool] = None
    allowed_token_ids: Optional[list[int]] = None

    def __post_init__(self) -> None:
        limit = MAX_LOGPROBS // 2
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or \
                not 1 <= self.beam_width <= limit:
            raise ValueError(f"beam_width={self.beam_width!r} must be an int in [1, {limit}] (each step reads the "
                             f"top 2 x beam_width logprobs, at most {MAX_LOGPROBS})")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        for name in ("structured_outputs", "allowed_token_ids", "watermarking"):
            if getattr(self, name):
                raise ValueError(f"BeamSearchParams.{name} is not supported by jaxllm's beam search")


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam (vLLM's ``BeamSearchSequence``): ``tokens`` are the prompt's then the generated ones, ``logprobs``
    one top-logprob dict per generated token, ``text`` (set on output) the decoded ``tokens``, prompt included, as
    vLLM's."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None


@dataclasses.dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first (vLLM's ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, length_penalty: float) -> float:
    """``cum_logprob / max(generated tokens, 1) ** length_penalty``, Transformers' and vLLM's beam score."""
    return beam.cum_logprob / (max(len(beam.logprobs), 1) ** length_penalty)


@dataclasses.dataclass
class _Instance:
    """One prompt's search: its live beams, the completed ones, its priority."""

    beams: list[BeamSearchSequence]
    priority: int
    completed: list[BeamSearchSequence] = dataclasses.field(default_factory=list)


RunStep = Callable[[list[list[int]], SamplingParams, list[Any], list[int]], list[RequestOutput]]


def beam_search(prompts: Sequence[list[int]], params: BeamSearchParams, run: RunStep, *, eos_token_ids: set[int],
                max_model_len: int, lora_requests: Sequence[Any], priorities: Sequence[int],
                decode: Optional[Callable[[list[int], bool], str]], concurrency_limit: Optional[int] = None,
                progress: Callable[[Any], Any] = lambda steps: steps) -> list[BeamSearchOutput]:
    """Beam search for every prompt (token ids), ``concurrency_limit`` prompts at a time (None: all).

    Args:
      run: one engine step of ``(beams' token ids, params, their LoRA requests, their priorities)`` -> one
        ``RequestOutput`` per beam, with ``params.logprobs`` top logprobs of its one token.
      eos_token_ids: the ids that complete a beam (unless ``params.ignore_eos``).
      max_model_len: a beam of this many tokens is complete ("length").
      decode: token ids, skip_special_tokens -> text; None leaves ``text`` None.
      progress: wraps the step range (a progress bar).

    Returns:
      one ``BeamSearchOutput`` per prompt, in order.
    """
    step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature,
                                 detokenize=False)
    instances = [_Instance([BeamSearchSequence(list(p), [], lora)], prio)
                 for p, lora, prio in zip(prompts, lora_requests, priorities)]
    limit = concurrency_limit or max(len(instances), 1)
    for start in range(0, len(instances), limit):
        batch = instances[start:start + limit]
        for _ in progress(range(params.max_tokens)):
            if not _step(batch, params, step_params, run, eos_token_ids, max_model_len):
                break
    outputs = []
    for instance in instances:
        ranked = sorted(instance.completed + instance.beams, key=lambda b: beam_score(b, params.length_penalty),
                        reverse=True)[:params.beam_width]
        for beam in ranked:
            beam.finish_reason = beam.finish_reason or "length"
            if decode is not None:
                beam.text = decode(beam.tokens, params.skip_special_tokens)
        outputs.append(BeamSearchOutput(ranked))
    return outputs


def _step(batch: list[_Instance], params: BeamSearchParams, step_params: SamplingParams, run: RunStep,
          eos_token_ids: set[int], max_model_len: int) -> bool:
    """Extend every live beam of ``batch`` by one token; False when no beam was live."""
    live = [(instance, beam) for instance in batch for beam in instance.beams]
    if not live:
        return False
    results = run([beam.tokens for _, beam in live], step_params, [beam.lora_request for _, beam in live],
                  [instance.priority for instance, _ in live])
    candidates: dict[int, list[BeamSearchSequence]] = {id(instance): [] for instance in batch}
    for (instance, beam), result in zip(live, results):
        top = result.outputs[0].logprobs[0]
        for token, entry in top.items():
            new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.lora_request,
                                     beam.cum_logprob + entry.logprob)
            if token in eos_token_ids and not params.ignore_eos:
                new.finish_reason = "stop"
                instance.completed.append(new)
            else:
                candidates[id(instance)].append(new)
    for instance in batch:
        ranked = sorted(candidates[id(instance)], key=lambda b: beam_score(b, params.length_penalty),
                        reverse=True)[:params.beam_width]
        instance.beams = []
        for beam in ranked:
            if len(beam.tokens) >= max_model_len:
                beam.finish_reason = "length"
                instance.completed.append(beam)
            else:
                instance.beams.append(beam)
    return True
