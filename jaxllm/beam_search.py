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


def check_beam_width(params: BeamSearchParams, max_logprobs: int) -> None:
    """Raise ValueError when a step's ``2 * beam_width`` logprobs are more than the engine's ``max_logprobs``
    serves (``EngineConfig.max_logprobs``, ``--max-logprobs``), naming both."""
    if 2 * params.beam_width > max_logprobs:
        raise ValueError(f"beam_width={params.beam_width} reads the top {2 * params.beam_width} logprobs a step, more "
                         f"than max_logprobs={max_logprobs} (--max-logprobs) allows")


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


class BeamSearch:
    """The beam searches of several prompts, one token step at a time: :meth:`live` says which beams the next
    step extends (each a request of ``step_params`` through the engine), :meth:`advance` takes the engine's outputs
    for them, :meth:`results` ranks what the searches found. A synchronous caller (``LLM.beam_search``) and an
    asyncio one (the server's ``use_beam_search``) drive it alike.

    Args:
      prompts: each prompt's token ids. params: the ``BeamSearchParams``.
      eos_token_ids: the ids that complete a beam (unless ``params.ignore_eos``).
      max_model_len: a beam of this many tokens is complete ("length").
      lora_requests, priorities: each prompt's, given to its beams' requests.
    """

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams, *, eos_token_ids: set[int],
                 max_model_len: int, lora_requests: Sequence[Any], priorities: Sequence[int]) -> None:
        self.params, self.eos_token_ids, self.max_model_len = params, eos_token_ids, max_model_len
        self.step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1,
                                          temperature=params.temperature, detokenize=False)
        self._instances = [_Instance([BeamSearchSequence(list(p), [], lora)], prio)
                           for p, lora, prio in zip(prompts, lora_requests, priorities)]
        self._steps = 0

    def live(self) -> list[BeamSearchSequence]:
        """The beams the next step extends, each with its prompt's ``lora_request`` (and :meth:`priority`); empty
        once every beam is complete or ``max_tokens`` steps have run."""
        if self._steps >= self.params.max_tokens:
            return []
        return [beam for instance in self._instances for beam in instance.beams]

    def priorities(self) -> list[int]:
        """The priority of each beam of :meth:`live`, in order."""
        return [instance.priority for instance in self._instances for _ in instance.beams]

    def advance(self, results: Sequence[RequestOutput]) -> None:
        """Extend the beams of :meth:`live` by the engine's outputs for them (one token each, with
        ``step_params.logprobs`` top logprobs): every candidate ending in an eos id is complete, the
        ``beam_width`` best of the others per prompt live on (a beam at ``max_model_len`` tokens is complete)."""
        params, width = self.params, self.params.beam_width
        self._steps += 1
        results = iter(results)
        for instance in self._instances:
            candidates = []
            for beam in instance.beams:
                top = next(results).outputs[0].logprobs[0]
                for token, entry in top.items():
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.lora_request,
                                             beam.cum_logprob + entry.logprob)
                    if token in self.eos_token_ids and not params.ignore_eos:
                        new.finish_reason, new.stop_reason = "stop", token
                        instance.completed.append(new)
                    else:
                        candidates.append(new)
            instance.beams = []
            for beam in sorted(candidates, key=lambda b: beam_score(b, params.length_penalty), reverse=True)[:width]:
                if len(beam.tokens) >= self.max_model_len:
                    beam.finish_reason = "length"
                    instance.completed.append(beam)
                else:
                    instance.beams.append(beam)

    def results(self, decode: Optional[Callable[[list[int], bool], str]]) -> list[BeamSearchOutput]:
        """Each prompt's ``beam_width`` best sequences, best first, their ``text`` decoded (None without
        ``decode``: token ids, skip_special_tokens -> text)."""
        outputs = []
        for instance in self._instances:
            ranked = sorted(instance.completed + instance.beams, reverse=True,
                            key=lambda b: beam_score(b, self.params.length_penalty))[:self.params.beam_width]
            for beam in ranked:
                beam.finish_reason = beam.finish_reason or "length"
                if decode is not None:
                    beam.text = decode(beam.tokens, self.params.skip_special_tokens)
            outputs.append(BeamSearchOutput(ranked))
        return outputs
