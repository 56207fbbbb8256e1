"""Front-end input processing: prompt and ``SamplingParams`` checked into an ``EngineCoreRequest`` (vLLM's
``InputProcessor``). A bad request fails here, before it changes any state; eos ids are folded into the
stop ids and missing seeds drawn here.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from typing import Any, Mapping, NamedTuple, NotRequired, Optional, Sequence, TypedDict, Union

import numpy as np

from jaxllm.core.messages import CoreInfo, EngineCoreRequest
from jaxllm.lora import LoRARequest
from jaxllm.structured_output import validate_structured_outputs
from scheduler import SamplingParams
from scheduler.policy import Policy, get_policy
from scheduler.sampling_params import MAX_LOGPROBS

class TextPrompt(TypedDict):
    """vLLM's ``TextPrompt``: text to tokenize, and the prefix-cache salt of this prompt alone."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """vLLM's ``TokensPrompt``: token ids, the text ``RequestOutput.prompt`` reports for them, and the prefix-cache
    salt of this prompt alone."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


# A prompt as vLLM's LLM, LLMEngine and AsyncLLM take one: text, token ids, or a TextPrompt / TokensPrompt dict.
PromptType = Union[str, Sequence[int], TextPrompt, TokensPrompt, Mapping[str, Any]]

# Keys of vLLM's prompt dicts that ask for what jaxllm's text-only, decoder-only models cannot do, and why; a dict
# with one of them (not None) is refused rather than served as if the key were absent.
REFUSED_PROMPT_KEYS = {
    "prompt_embeds": "prompts given as embeddings are not supported; give 'prompt' (text) or 'prompt_token_ids'",
    "prompt_is_token_ids": "prompts given partly as embeddings are not supported",
    "encoder_prompt": "encoder-decoder prompts are not supported: the models are decoder-only",
    "decoder_prompt": "encoder-decoder prompts are not supported: the models are decoder-only",
    "data": "inputs for an IO processor plugin are not supported",
}
# Keys that say nothing a text-only model reads once ``multi_modal_data`` is empty (vLLM's multimodal options), or
# that only pooling models read (``token_type_ids``), or that describe the prompt (``prompt_token_offsets``).
IGNORED_PROMPT_KEYS = ("mm_processor_kwargs", "media_io_kwargs", "multi_modal_uuids", "token_type_ids",
                       "prompt_token_offsets")


def add_special_tokens(tokenization_kwargs: Optional[Mapping[str, Any]], default: bool = True) -> bool:
    """Whether text is encoded with the tokenizer's special tokens, from vLLM's ``tokenization_kwargs`` (overrides for
    ``tokenizer.encode``). Raises ValueError: a key other than ``add_special_tokens``, named."""
    options = dict(tokenization_kwargs or {})
    add = options.pop("add_special_tokens", default)
    if options:
        raise ValueError(f"tokenization_kwargs keys {sorted(options)} are not supported (only add_special_tokens); "
                         "tokenize the prompt yourself and give its prompt_token_ids")
    if not isinstance(add, (bool, np.bool_)):
        raise ValueError(f"tokenization_kwargs add_special_tokens={add!r} must be a bool")
    return bool(add)


class ParsedPrompt(NamedTuple):
    """One prompt read by ``InputProcessor.parse_prompt``: its text (None for ids given without one), token ids,
    and the ``cache_salt`` a prompt dict carries (None: none)."""

    text: Optional[str]
    token_ids: list[int]
    cache_salt: Optional[str]


def bad_words_token_ids(tokenizer, bad_words: Sequence[str]) -> list[list[int]]:
    """Token sequences of ``bad_words``: each word bare and with a leading space (unlike vLLM, a spaced encoding
    of another length is kept)."""
    out: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced != plain:
            out.append(spaced)
    return out


class InputProcessor:
    """Validates requests and builds core requests for one model. tokenizer: the model's, or None (token-id
    prompts only); info: the core's ``CoreInfo``; seed: the engine seed; scheduling_policy: a non-zero priority is
    refused unless it ``reads_priority``; max_logprobs: the most ``logprobs`` / ``prompt_logprobs`` a request may
    ask for (``EngineConfig.max_logprobs``; -1: ``MAX_LOGPROBS``).
    """

    def __init__(self, tokenizer, info: CoreInfo, seed: int = 0,
                 scheduling_policy: Union[str, Policy] = "fcfs", max_logprobs: int = MAX_LOGPROBS) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.max_logprobs = MAX_LOGPROBS if max_logprobs == -1 else max_logprobs
        self._seed_rng = np.random.default_rng(seed)
        policy = get_policy(scheduling_policy)
        self._priority_blind_policy = None if policy.reads_priority else policy.name

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation: the tokenizer's, then the model's configs', no repeats; the first is primary."""
        ids = list(self.tokenizer.eos_token_ids) if self.tokenizer is not None else []
        return list(dict.fromkeys(ids + list(self.info.eos_token_ids)))

    def parse_prompt(self, prompt: PromptType, cache_salt: Optional[str] = None,
                     add_special_tokens: bool = True) -> ParsedPrompt:
        """A prompt in any of vLLM's forms: text, token ids, ``{"prompt": text}`` (vLLM's ``TextPrompt``) or
        ``{"prompt_token_ids": ids, "prompt": its text (optional)}`` (``TokensPrompt``), either dict with a
        ``cache_salt`` (``cache_salt``: the caller's, which a dict's must equal when both are given). Multimodal
        options are accepted while ``multi_modal_data`` is empty, as are :data:`IGNORED_PROMPT_KEYS`. Text is
        encoded with the tokenizer's special tokens unless ``add_special_tokens`` is False.

        Raises:
          ValueError: as :meth:`encode_prompt`; a dict with neither ``prompt`` nor ``prompt_token_ids``, with
            ``multi_modal_data``, with one of :data:`REFUSED_PROMPT_KEYS` (the key named), or with a
            ``cache_salt`` unlike the caller's.
        """
        if not isinstance(prompt, Mapping):
            return ParsedPrompt(*self.encode_prompt(prompt, add_special_tokens), cache_salt)
        for key, why in REFUSED_PROMPT_KEYS.items():
            if prompt.get(key) is not None:
                raise ValueError(f"prompt key {key!r}: {why}")
        if prompt.get("multi_modal_data"):
            raise ValueError(f"prompt key 'multi_modal_data' ({', '.join(map(str, prompt['multi_modal_data']))}): "
                             "the models take text and token ids only")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt key 'prompt' must be a string (the text); got {type(text).__name__}")
        if prompt.get("prompt_token_ids") is not None:
            ids = self.encode_prompt(self._token_ids(prompt["prompt_token_ids"]))[1]
        elif text is not None:
            ids = self.encode_prompt(text, add_special_tokens)[1]
        else:
            raise ValueError("a prompt dict needs 'prompt' (text, vLLM's TextPrompt) or 'prompt_token_ids' (vLLM's "
                             f"TokensPrompt); it has {sorted(map(str, prompt))}")
        salt = prompt.get("cache_salt")
        if salt is not None and cache_salt is not None and salt != cache_salt:
            raise ValueError(f"the prompt's cache_salt {salt!r} differs from cache_salt={cache_salt!r}")
        return ParsedPrompt(text, ids, cache_salt if salt is None else salt)

    @staticmethod
    def _token_ids(values: Any) -> list[int]:
        """``values`` (a sequence, or a 1-D numpy or JAX array) as a list of ints; an entry may be anything
        ``operator.index`` takes (a numpy or JAX integer scalar). Raises ValueError: not a sequence, or an entry that
        is not an integer (a float or bool would otherwise be read as another id)."""
        if hasattr(values, "dtype") and hasattr(values, "ndim"):  # a numpy or JAX array: one check of its dtype
            array = np.asarray(values)
            if array.ndim != 1 or array.dtype.kind not in "iu":
                raise ValueError(f"prompt token ids must be a 1-D array of integers; got {array.ndim}-D "
                                 f"{array.dtype}")
            return array.tolist()
        if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
            raise ValueError(f"prompt token ids must be a list of integers; got {type(values).__name__}")
        ids = list(values)
        if all(type(t) is int for t in ids):
            return ids
        out = []
        for t in ids:
            try:
                if isinstance(t, (bool, np.bool_)) or getattr(getattr(t, "dtype", None), "kind", "i") == "b":
                    raise TypeError
                out.append(operator.index(t))
            except TypeError:
                raise ValueError(f"prompt token ids must be integers; got {t!r} ({type(t).__name__})") from None
        return out

    def encode_prompt(self, prompt: Union[str, Sequence[int]],
                      add_special_tokens: bool = True) -> tuple[Optional[str], list[int]]:
        """Prompt text (encoded with the special tokens unless ``add_special_tokens`` is False) or ids ->
        (text or None, token ids).
        Raises ValueError: an empty prompt, text without a tokenizer or that encodes to no token, an id that is not
        an integer or is outside ``[0, vocab_size)``."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token id")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids instead of text")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            if not ids:
                raise ValueError("the prompt encodes to no tokens" +
                                 ("" if add_special_tokens else " without special tokens"))
            return prompt, ids
        ids = self._token_ids(prompt)
        if not ids:
            raise ValueError("prompt is empty: give at least one character or token id")
        vocab = self.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return None, ids

    def process(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0,
                arrival_time: Optional[float] = None, cache_salt: Optional[str] = None,
                lora_request: Optional[LoRARequest] = None) -> EngineCoreRequest:
        """The core request for an encoded prompt (``lora_request``: its adapter, checked by the core).

        Raises:
          ValueError: a prompt over ``max_model_len`` (both numbers named), ids outside the vocabulary, bad words
            that encode to nothing or too many, an invalid ``structured_outputs`` (field named), a non-zero
            ``priority`` the policy ignores, an empty ``cache_salt``, a ``lora_request`` not a ``LoRARequest``, or
            ``logprobs`` / ``prompt_logprobs`` over ``max_logprobs`` (both named).
        """
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request={lora_request!r} must be a jaxllm.LoRARequest (or None)")
        if len(prompt_token_ids) > self.info.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens is longer than max_model_len={self.info.max_model_len}"
            )
        vocab = self.info.vocab_size
        params.validate_for_vocab(vocab)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise ValueError(f"{name}={asked} is more than max_logprobs={self.max_logprobs}, the most this engine "
                                 "serves")
        if not isinstance(priority, (int, np.integer)) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r} must be an int")
        if priority != 0 and self._priority_blind_policy is not None:
            raise ValueError(f"priority={priority} is not honoured by scheduling_policy="
                             f"'{self._priority_blind_policy}', which ignores priorities: send priority 0, or "
                             "start the engine with scheduling_policy 'priority', 'aging' or 'load_aware'")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt={cache_salt!r} must be a non-empty string (or None)")
        eos = self.eos_token_ids
        if len(eos) > 1 and not params.ignore_eos:
            params = dataclasses.replace(
                params, stop_token_ids=list(params.stop_token_ids) + [e for e in eos[1:] if e not in params.stop_token_ids]
            )
        # min_tokens bans every id that would end the request: stop ids and all eos ids.
        stop_ids = list(dict.fromkeys(list(params.stop_token_ids) + ([] if params.ignore_eos else eos)))
        words = self._bad_words(params, vocab)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.structured_outputs needs a tokenizer; this model has none")
            validate_structured_outputs(params.structured_outputs)
        seeds = [params.seed + i if params.seed is not None else int(self._seed_rng.integers(0, 2**32))
                 for i in range(params.n)]
        return EngineCoreRequest(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params, seeds=seeds,
            stop_ids=stop_ids, bad_words_token_ids=words, eos_token_id=eos[0] if eos else None,
            arrival_time=time.monotonic() if arrival_time is None else float(arrival_time), priority=int(priority),
            cache_salt=cache_salt, lora_request=lora_request,
        )

    def _bad_words(self, params: SamplingParams, vocab: int) -> list[list[int]]:
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer; this model has none")
        words = bad_words_token_ids(self.tokenizer, params.bad_words)
        if any(not w or not all(0 <= t < vocab for t in w) for w in words):
            raise ValueError(f"SamplingParams.bad_words={params.bad_words!r} encodes to no token or out-of-vocabulary ids")
        multi = [w for w in words if len(w) > 1]
        if len(multi) > self.info.max_banned_ids:
            raise ValueError(f"SamplingParams.bad_words gives {len(multi)} multi-token sequences; at most "
                             f"{self.info.max_banned_ids} are supported")
        return words
