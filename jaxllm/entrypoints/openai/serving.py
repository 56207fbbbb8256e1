"""OpenAI-compatible endpoints: requests -> ``SamplingParams`` and prompts, outputs -> bodies and SSE chunks.

Follows vLLM's ``OpenAIServingCompletion`` / ``OpenAIServingChat``: ``max_tokens`` is checked against the room
under ``max_model_len`` (400 past it), omitted sampling fields take ``generation_config.json``'s values, and
choices are numbered ``prompt_index * n + i``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

import msgspec

from jaxllm.beam_search import BeamSearch, BeamSearchParams, check_beam_width
from jaxllm.frontend.async_llm import AsyncLLM
from jaxllm.entrypoints.openai.chat_outputs import ChatParsing, reasoning_token_count
from jaxllm.entrypoints.openai.field_policy import refusal
from jaxllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionTool,
    CompletionRequest,
    NamedToolChoice,
    StreamOptions,
    TokenizeRequest,
)
from jaxllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, THINK_END, opens_reasoning
from jaxllm.entrypoints.openai.serving_models import OpenAIServingModels
from jaxllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedParser,
    RequiredParser,
    ToolParser,
    parameters_schema,
    required_schema,
)
from jaxllm.logger import init_logger
from jaxllm.lora import LoRARequest
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.structured_output import after_reasoning, validate_structured_outputs
from jaxllm.tokenizer import ChatInputError
from scheduler import RequestOutputKind, SamplingParams, StructuredOutputsParams
from scheduler.sampling_params import MAX_LOGPROBS

logger = init_logger(__name__)

# Sampling fields the model's generation_config.json may set defaults for.
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
AUTO_TOOLS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_PARAM = re.compile(r"SamplingParams\.(\w+)=")


def _sse(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def merge(streams: Sequence[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index; leaving early closes them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out = await queue.get()
            if out is None:
                remaining -= 1
            elif isinstance(out, Exception):
                raise out
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Server-wide settings from vLLM's frontend flags of the same names (``jaxllm.entrypoints.vllm_flags``).

    response_role: a chat completion's message role when the request adds the generation prompt (else the last
    message's role). return_tokens_as_token_ids: every request's default for the field (with logprobs).
    enable_force_include_usage: every stream carries usage on each chunk and in a last chunk, whatever
    ``stream_options`` say (vLLM's ``should_include_usage``).
    default_chat_template_kwargs: chat template variables under each request's ``chat_template_kwargs``.
    enable_log_requests: log each engine request's id, prompt length and ``SamplingParams`` at info.
    exclude_tools_when_tool_choice_none: a chat with ``tool_choice: "none"`` is rendered without its tools.
    chat_template_content_format: how message content reaches the template (``tokenizer.CONTENT_FORMATS``).
    """

    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    default_chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    enable_log_requests: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    chat_template_content_format: str = "auto"


class OpenAIServing:
    """Completions, chat, tokenize and detokenize over one ``AsyncLLM``.

    Args:
      engine: the ``AsyncLLM``.
      model_name: the name clients use (``--served-model-name``).
      generation_defaults: ``SamplingParams`` defaults from the model's generation config.
      tool_call_parser: a ``TOOL_PARSERS`` name (``--tool-call-parser``), read with ``tool_choice: "auto"``.
      enable_auto_tool_choice: ``--enable-auto-tool-choice`` (needs ``tool_call_parser``).
      reasoning_parser: a ``REASONING_PARSERS`` name (``--reasoning-parser``).
      models: the ``OpenAIServingModels`` a request's ``model`` is looked up in (default: ``model_name`` alone,
        no adapters).
      options: the :class:`ServerOptions` (default: vLLM's defaults).

    Raises:
      ValueError: an unknown parser name, or ``enable_auto_tool_choice`` without ``tool_call_parser``.
    """

    def __init__(self, engine: AsyncLLM, model_name: str, generation_defaults: dict[str, Any],
                 tool_call_parser: Optional[str] = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: Optional[str] = None,
                 models: Optional[OpenAIServingModels] = None, options: Optional[ServerOptions] = None) -> None:
        self.options = options if options is not None else ServerOptions()
        check_parsers(tool_call_parser, enable_auto_tool_choice, reasoning_parser)
        self.tool_parser = TOOL_PARSERS[tool_call_parser] if enable_auto_tool_choice else None
        self.tool_call_id = (TOOL_PARSERS[tool_call_parser] if tool_call_parser else ToolParser).new_id
        self.reasoning_parser = REASONING_PARSERS[reasoning_parser] if reasoning_parser is not None else None
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.defaults = {k: v for k, v in generation_defaults.items() if k in DEFAULTABLE}
        # The generation config's max_new_tokens: the completion length of a request that sets none (vLLM's).
        self.default_max_tokens: Optional[int] = generation_defaults.get("max_tokens")
        self.max_model_len = engine.info.max_model_len
        self.models = models if models is not None else OpenAIServingModels(engine, model_name, model_name,
                                                                             self.max_model_len)

    def check_model(self, name: Optional[str]) -> Optional[LoRARequest]:
        """The LoRA adapter a request's ``model`` names (None: the base model). Raises: APIError 404 for a model
        name this server does not serve."""
        return self.models.lora_request(name)

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompt token ids", "prompt")

    def encode(self, prompt: Union[str, list[int]], param: str,
               add_special_tokens: bool = True) -> tuple[Optional[str], list[int]]:
        """(text or None, token ids) of one prompt (text without the tokenizer's special tokens unless
        ``add_special_tokens``). Raises: APIError 400 (empty, out of vocabulary)."""
        try:
            text, ids = self.engine.input_processor.encode_prompt(prompt)
        except ValueError as e:
            raise APIError(400, str(e), param) from None
        if text is not None and not add_special_tokens:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise APIError(400, "prompt encodes to no tokens without special tokens", param)
        return text, ids

    def truncate(self, ids: list[int], request: Union[CompletionRequest, ChatCompletionRequest]) -> list[int]:
        """``ids`` cut to the request's ``truncate_prompt_tokens`` (-1: ``max_model_len``) on its
        ``truncation_side`` (default left: the last tokens kept), as vLLM.

        Raises:
          APIError: 400 naming ``truncate_prompt_tokens`` for 0 or a value over ``max_model_len``.
        """
        k = request.truncate_prompt_tokens
        if k is None:
            return ids
        keep = self.max_model_len if k == -1 else k
        if not 1 <= keep <= self.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens={k} must be -1 or in [1, max_model_len="
                                f"{self.max_model_len}]", "truncate_prompt_tokens")
        if len(ids) <= keep:
            return ids
        return ids[:keep] if request.truncation_side == "right" else ids[len(ids) - keep:]

    def render_chat_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                         continue_final_message: bool = False, tools: Optional[list[dict]] = None,
                         template_kwargs: Optional[dict[str, Any]] = None) -> str:
        """A conversation in the chat template (``Tokenizer.render_chat``) with OpenAI ``tools`` and template variables.

        Raises:
          APIError: 400 naming ``ChatInputError``'s field.
        """
        self._need_tokenizer()
        try:
            return self.tokenizer.render_chat(messages, add_generation_prompt, continue_final_message, tools,
                                              template_kwargs,
                                              content_format=self.options.chat_template_content_format)
        except ChatInputError as e:
            raise APIError(400, str(e), e.field) from None

    def sampling_params(self, request: Union[CompletionRequest, ChatCompletionRequest], prompt_len: int,
                        max_tokens: Optional[int], logprobs: Optional[int], prompt_logprobs: Optional[int] = None,
                        logprobs_param: str = "logprobs", score_prompt: bool = False,
                        constraint: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        """The request's ``SamplingParams`` for a ``prompt_len``-token prompt under ``constraint`` (checked).

        A scored prompt (``echo``, ``max_tokens: 0``) runs with ``max_tokens=1``; ``score_response`` drops the token.

        Raises:
          APIError: 400 naming the field and its limit.
        """
        room = self.max_model_len - prompt_len
        if room < 0:
            raise APIError(400, f"prompt of {prompt_len} tokens is longer than max_model_len={self.max_model_len}",
                           "messages" if isinstance(request, ChatCompletionRequest) else "prompt")
        if score_prompt:
            max_tokens = 1
        elif max_tokens is None:
            if room < 1:
                raise APIError(400, f"the prompt has {prompt_len} tokens, which leaves no room for a completion "
                                    f"under max_model_len={self.max_model_len}", "messages")
            max_tokens = room if self.default_max_tokens is None else min(room, self.default_max_tokens)
        elif isinstance(max_tokens, int) and max_tokens >= 1 and prompt_len + max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                                "for the completion). Reduce the length of the prompt or max_tokens.", "max_tokens")
        limit = self.engine.input_processor.max_logprobs
        for param, asked in ((logprobs_param, logprobs), ("prompt_logprobs", request.prompt_logprobs)):
            # Past MAX_LOGPROBS, SamplingParams' own check names the limit jaxllm computes.
            if isinstance(asked, int) and limit < asked <= MAX_LOGPROBS:
                raise APIError(400, f"{param}={asked} is more than max_logprobs={limit}, the most this server serves "
                                    "(--max-logprobs)", param)
        values = dict(self.defaults)
        values.update({k: getattr(request, k) for k in DEFAULTABLE if getattr(request, k) is not None})
        try:
            logit_bias = {int(k): v for k, v in request.logit_bias.items()} if request.logit_bias else None
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {list(request.logit_bias)[:5]}",
                           "logit_bias") from None
        try:
            return SamplingParams(
                n=request.n, presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens, stop=request.stop,
                stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, logit_bias=logit_bias, allowed_token_ids=request.allowed_token_ids,
                bad_words=request.bad_words,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                structured_outputs=constraint, **values,
            )
        except ValueError as e:
            match = _PARAM.search(str(e))
            param = match[1] if match else None
            message = str(e).replace("SamplingParams.", "")
            if param == "logprobs":  # a chat asks for its top logprobs as top_logprobs
                param, message = logprobs_param, message.replace("logprobs=", f"{logprobs_param}=", 1)
            raise APIError(400, message, param) from None

    def start(self, prefix: str, prompts: list[tuple[Optional[str], list[int]]], params: list[SamplingParams],
              request: Union[CompletionRequest, ChatCompletionRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Start one engine request per prompt (all or none), with the request's ``priority``, ``cache_salt`` and
        the LoRA adapter its ``model`` names.

        Raises:
          APIError: 400 naming the field for a request the engine refuses; 404 for a model no longer served.
          QueueFullError, EngineDeadError: as ``AsyncLLM.add_request``.
        """
        ids = [f"{prefix}-{i}" for i in range(len(prompts))]
        lora = self.check_model(request.model)
        if (request.model_extra or {}).get("use_beam_search"):
            beams = [self._beam_search_params(request, p) for p in params]
            searches = []
            try:
                for rid, (text, token_ids), beam in zip(ids, prompts, beams):
                    searches.append(self._start_beam_search(rid, text, token_ids, beam, lora, request))
            except BaseException:
                for rid in ids[:len(searches)]:  # the searches started: their first step's one request each
                    self.engine.cancel(f"{rid}-beam-0-0")
                raise
            return searches
        streams = []
        try:
            for rid, (text, token_ids), p in zip(ids, prompts, params):
                if self.options.enable_log_requests:
                    logger.info(f"request {rid}: {len(token_ids)} prompt tokens, {p}")
                streams.append(self.engine.add_request(rid, token_ids, p, prompt=text, priority=request.priority,
                                                       cache_salt=request.cache_salt, lora_request=lora))
        except ValueError as e:
            for rid in ids:
                self.engine.cancel(rid)
            raise _engine_refusal(e) from None
        except BaseException:
            for rid in ids:
                self.engine.cancel(rid)
            raise
        return streams

    def _beam_search_params(self, request: Union[CompletionRequest, ChatCompletionRequest],
                            params: SamplingParams) -> BeamSearchParams:
        """vLLM's ``use_beam_search``: ``n`` beams of the request's ``max_tokens``, ``ignore_eos``,
        ``length_penalty``, ``include_stop_str_in_output`` and ``skip_special_tokens``. The fields that shape a
        sampled token (penalties, stops, bias) do not apply to beams, as in vLLM.

        Raises:
          APIError: 400 naming a field beam search does not serve here (logprobs, prompt logprobs, a structured
            output or what asked for one, allowed_token_ids), or a bad ``n`` or ``length_penalty``.
        """
        chat = isinstance(request, ChatCompletionRequest)
        constraint = ("response_format" if getattr(request, "response_format", None) is not None else
                      "tool_choice" if chat and request.tool_choice not in (None, "none", "auto") else
                      "structured_outputs")
        logprobs = "top_logprobs" if chat and request.top_logprobs is not None else "logprobs"
        for field, asked in ((logprobs, params.logprobs), ("prompt_logprobs", params.prompt_logprobs),
                             (constraint, params.structured_outputs), ("allowed_token_ids", params.allowed_token_ids)):
            if asked is not None:
                raise APIError(400, f"{field} cannot be used with use_beam_search here: the beams are the model's "
                                    "own most likely continuations, returned as tokens alone", field)
        penalty = (request.model_extra or {}).get("length_penalty", 1.0)
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)):
            raise APIError(400, f"length_penalty={penalty!r} must be a number", "length_penalty")
        try:
            beam = BeamSearchParams(beam_width=request.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                    temperature=params.temperature, length_penalty=float(penalty),
                                    include_stop_str_in_output=params.include_stop_str_in_output,
                                    skip_special_tokens=params.skip_special_tokens)
            check_beam_width(beam, self.engine.input_processor.max_logprobs)
            return beam
        except ValueError as e:
            raise APIError(400, f"n={request.n} beams: {e}", "n") from None

    def _start_beam_search(self, request_id: str, text: Optional[str], ids: list[int], params: BeamSearchParams,
                           lora: Optional[LoRARequest], request: Union[CompletionRequest, ChatCompletionRequest]
                           ) -> AsyncIterator[RequestOutput]:
        """One prompt's beam search (vLLM's online ``beam_search``), its first step queued now, so that a refusal
        (priority, cache_salt, LoRA, a full queue) reaches the client before any response starts.

        Returns:
          the search's outputs: one finished ``RequestOutput`` of ``n`` outputs, best first, each its generated
          tokens (an eos kept only with ``include_stop_str_in_output``, never in the text).

        Raises:
          APIError: 400 for a step the engine refuses. QueueFullError, EngineDeadError: as ``AsyncLLM.add_request``.
        """
        search = BeamSearch([ids], params, eos_token_ids=set(self.engine.input_processor.eos_token_ids),
                            max_model_len=self.max_model_len, lora_requests=[lora], priorities=[request.priority])
        first = self._beam_step(search, f"{request_id}-beam-0", lora, request, admitted=False)
        return self._beam_search(search, first, request_id, text, ids, lora, request)

    def _beam_step(self, search: BeamSearch, prefix: str, lora: Optional[LoRARequest],
                   request: Union[CompletionRequest, ChatCompletionRequest], admitted: bool
                   ) -> tuple[list[str], list[AsyncIterator[RequestOutput]]]:
        """Queue one request per live beam of ``search`` (all or none); their ids and output iterators.
        ``admitted``: a later step, not held to ``max_waiting_requests`` again. Raises as :meth:`_start_beam_search`."""
        beams = search.live()
        rids = [f"{prefix}-{i}" for i in range(len(beams))]
        streams = []
        try:
            for rid, beam in zip(rids, beams):
                streams.append(self.engine.add_request(rid, beam.tokens, search.step_params, priority=request.priority,
                                                       cache_salt=request.cache_salt, lora_request=lora,
                                                       admitted=admitted))
        except BaseException as e:
            for rid in rids:
                self.engine.cancel(rid)
            if isinstance(e, ValueError):
                raise _engine_refusal(e) from None
            raise
        return rids, streams

    async def _beam_search(self, search: BeamSearch, first: tuple[list[str], list[AsyncIterator[RequestOutput]]],
                           request_id: str, text: Optional[str], ids: list[int], lora: Optional[LoRARequest],
                           request: Union[CompletionRequest, ChatCompletionRequest]) -> AsyncIterator[RequestOutput]:
        """Run ``search`` from its queued ``first`` step to the end (:meth:`_start_beam_search`); leaving early, or a
        failed step, aborts the step's requests."""
        async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
            try:
                async for out in stream:
                    if out.finished:
                        return out
                raise RuntimeError("a beam search step ended without an output")
            finally:
                await stream.aclose()

        rids, streams, step = *first, 0
        while True:
            try:
                search.advance(await asyncio.gather(*map(last, streams)))
            except BaseException:
                for rid in rids:  # a stream never iterated does not abort its request when closed
                    self.engine.cancel(rid)
                raise
            if not search.live():
                break
            step += 1
            rids, streams = self._beam_step(search, f"{request_id}-beam-{step}", lora, request, admitted=True)
        eos = search.eos_token_ids
        outputs = []
        for i, beam in enumerate(search.results(None)[0].sequences):
            tokens = beam.tokens[len(ids):]
            generated = tokens[:-1] if beam.finish_reason == "stop" and tokens[-1:] and tokens[-1] in eos else tokens
            if not search.params.include_stop_str_in_output:
                tokens = generated
            out_text = (self.tokenizer.decode(generated, skip_special_tokens=search.params.skip_special_tokens)
                        if self.tokenizer is not None else "")
            outputs.append(CompletionOutput(i, out_text, tokens, beam.finish_reason, beam.stop_reason,
                                            beam.cum_logprob, None, out_text, tokens))
        yield RequestOutput(request_id, text, ids, outputs, True, outputs[0].delta_text, outputs[0].delta_token_ids)

    # ------------------------------------------------------------------ completions

    def completion_prompts(self, request: CompletionRequest) -> list[tuple[Optional[str], list[int]]]:
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt is empty: give a string, a list of strings or token ids", "prompt")
        if any(isinstance(p, str) for p in prompts):
            self._need_tokenizer()
        encoded = [self.encode(p, "prompt", request.add_special_tokens) for p in prompts]
        # A cut prompt's text is decoded from the ids kept (echo shows what the model read).
        return [(text, ids) if len(kept) == len(ids) else (None, kept)
                for (text, ids), kept in ((e, self.truncate(e[1], request)) for e in encoded)]

    def completion_inputs(self, request: CompletionRequest
                          ) -> tuple[list[tuple[Optional[str], list[int]]], list[SamplingParams]]:
        """A completion request checked: its prompts (text or None, token ids) and each one's ``SamplingParams``.

        Raises:
          APIError: as the completions route answers (404 for another model, 400 naming the field).
        """
        self.check_model(request.model)
        check_fields("completions", request)
        self._server_defaults(request)
        check_combination(request)
        prompts = self.completion_prompts(request)
        echo_logprobs = request.logprobs if request.echo else None
        # One computation serves both: the echo's top tokens and prompt_logprobs' are cut to their own k.
        wanted = [k for k in (echo_logprobs, request.prompt_logprobs) if k is not None]
        constraint = structured_outputs(request)
        params = [self.sampling_params(request, len(ids), request.max_tokens, request.logprobs,
                                       prompt_logprobs=max(wanted, default=None), score_prompt=scores_prompt(request),
                                       constraint=constraint)
                  for _, ids in prompts]
        return prompts, params

    def prepare_completion(self, request: CompletionRequest):
        """Check and start a completion request; returns (id, created, prompts, streams)."""
        prompts, params = self.completion_inputs(request)
        params = [_output_kind(p, request) for p in params]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = self.start(request_id, prompts, params, request)
        return request_id, int(time.time()), prompts, streams

    def _prompt_text(self, prompt: tuple[Optional[str], list[int]]) -> str:
        text, ids = prompt
        if text is not None:
            return text
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    async def completion(self, request: CompletionRequest, started) -> dict:
        """The whole ``text_completion`` response of a non-streaming request."""
        request_id, created, prompts, streams = started
        final: dict[int, RequestOutput] = {}
        async for i, out in merge(streams):
            if out.finished:
                final[i] = out
        choices, completion_tokens = [], 0
        for i in range(len(prompts)):
            out = final[i]
            prefix = self._prompt_text(prompts[i]) if request.echo else ""
            for c in out.outputs:
                if scores_prompt(request):
                    c = score_response(c)
                completion_tokens += len(c.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    echoed = out.prompt_logprobs if request.echo else None
                    rows = ((_prompt_rows(out.prompt_token_ids, echoed, request.logprobs) if request.echo else [])
                            + _output_rows(c, len(c.token_ids)))
                    logprobs, _ = self._completion_logprobs(rows, 0, as_ids=request.return_tokens_as_token_ids)
                choice = {"index": i * request.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_body(out, request.prompt_logprobs)
                choices.append(choice)
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        cached = sum(final[i].num_cached_tokens for i in range(len(prompts)))
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": self.models.model_name(request.model), "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens, cached)}

    async def completion_stream(self, request: CompletionRequest, started) -> AsyncIterator[bytes]:
        """The ``text_completion`` chunks of a streaming request, then the usage chunk if asked, then [DONE]."""
        request_id, created, prompts, streams = started
        include_usage, continuous = usage_options(request)
        base = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.models.model_name(request.model)}
        choices = StreamedChoices(len(prompts), request.n)
        offsets = [0] * (len(prompts) * request.n)  # each choice's next text_offset
        try:
            async for i, index, first, out, c in choices.updates(merge(streams)):
                text, rows = c.delta_text, []
                if request.echo and first:
                    text = self._prompt_text(prompts[i]) + text
                    rows = _prompt_rows(out.prompt_token_ids, choices.prompt_logprobs[i], request.logprobs)
                logprobs = None
                if request.logprobs is not None:
                    rows += _output_rows(c, len(c.delta_token_ids))
                    logprobs, offsets[index] = self._completion_logprobs(rows, offsets[index],
                                                                         as_ids=request.return_tokens_as_token_ids)
                chunk = {**base, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                              "finish_reason": c.finish_reason,
                                              "stop_reason": c.stop_reason if c.finish_reason else None}]}
                if include_usage:
                    chunk["usage"] = _usage(len(prompts[i][1]), choices.tokens(index), out.num_cached_tokens) \
                        if continuous else None
                yield _sse(chunk)
            if include_usage:
                prompt_tokens = sum(len(ids) for _, ids in prompts)
                yield _sse({**base, "choices": [],
                            "usage": _usage(prompt_tokens, choices.num_tokens, choices.num_cached_tokens)})
        except Exception as e:
            yield _sse(stream_error(e))
        yield SSE_DONE

    def _completion_logprobs(self, rows: list[tuple[int, Optional[dict[int, Logprob]]]], offset: int,
                             as_ids: bool = False) -> tuple[dict, int]:
        """OpenAI's legacy ``logprobs`` of ``rows`` from character ``offset``; returns it and the offset after it.

        A top token whose text another id already has is keyed ``token_id:ID``; ``as_ids`` keys all tokens so.
        """
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in rows:
            text = self._token_text(token_id, entry)
            out["tokens"].append(_token_id_label(token_id) if as_ids else text)
            out["token_logprobs"].append(None if entry is None else entry[token_id].logprob)
            top = None
            if entry is not None:
                top = {}
                for t, lp in entry.items():
                    key = self._token_text(t, entry)
                    top[_token_id_label(t) if as_ids or key in top else key] = lp.logprob
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset

    def _token_text(self, token_id: int, entry: Optional[dict[int, Logprob]]) -> str:
        if entry is not None and entry[token_id].decoded_token is not None:
            return entry[token_id].decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else ""

    # ------------------------------------------------------------------ chat

    def chat_inputs(self, request: ChatCompletionRequest
                    ) -> tuple[list[int], ChatParsing, SamplingParams]:
        """A chat request checked: its prompt's token ids, how its choices are read, its ``SamplingParams``.

        Raises:
          APIError: as the chat route answers (404 for another model, 400 naming the field).
        """
        self.check_model(request.model)
        check_fields("chat", request)
        self._server_defaults(request)
        check_combination(request)
        excluded = self.options.exclude_tools_when_tool_choice_none and request.tool_choice == "none"
        text = self.render_chat_text(request.messages, request.add_generation_prompt, request.continue_final_message,
                                     None if excluded else tool_dicts(request.tools),
                                     chat_template_kwargs(request, self.options.default_chat_template_kwargs))
        ids = self.truncate(self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens), request)
        parsing, constraint = self.chat_parsing(request, opens_reasoning(text))
        if parsing.tools is not None and parsing.tools().keeps_special_tokens \
                and "skip_special_tokens" not in request.model_fields_set:
            request = request.model_copy(update={"skip_special_tokens": False})
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, len(ids), max_tokens, logprobs, prompt_logprobs=request.prompt_logprobs,
                                      logprobs_param="top_logprobs", constraint=constraint)
        return ids, parsing, params

    def _server_defaults(self, request: Union[CompletionRequest, ChatCompletionRequest]) -> None:
        """Set the request's fields the :class:`ServerOptions` default (in place, before it is checked): a field
        the request sets itself keeps its value."""
        if self.options.return_tokens_as_token_ids and "return_tokens_as_token_ids" not in request.model_fields_set \
                and request.logprobs is not None and request.logprobs is not False:
            request.return_tokens_as_token_ids = True
        if self.options.enable_force_include_usage and request.stream:
            # vLLM's should_include_usage: usage on every chunk and a last usage chunk, whatever stream_options say.
            request.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)

    def role(self, request: ChatCompletionRequest) -> str:
        """The role of a chat completion's message, as vLLM's: ``response_role`` when the request adds the
        generation prompt, else its last message's."""
        if request.add_generation_prompt or not request.messages:
            return self.options.response_role
        return request.messages[-1].get("role", self.options.response_role)

    def prepare_chat(self, request: ChatCompletionRequest, set_output_kind: bool = True):
        """Check and start a chat request; returns (id, created, prompt ids, streams, parsing, ``SamplingParams``).
        ``set_output_kind`` False: the parameters' own output kind (the Responses API reads each step's cumulative
        output), else :func:`_output_kind`'s.
        """
        ids, parsing, params = self.chat_inputs(request)
        if set_output_kind:
            params = _output_kind(params, request)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self.start(request_id, [(None, ids)], [params], request)
        return request_id, int(time.time()), ids, streams, parsing, params

    def chat_parsing(self, request: ChatCompletionRequest, prompt_opens: bool
                     ) -> tuple[ChatParsing, Optional[StructuredOutputsParams]]:
        """How the request's choices are read and the constraint its output is under (``prompt_opens``: inside think).

        Raises:
          APIError: 400 naming ``tool_choice``, ``tools`` or the constraint's field.
        """
        tool_parser, constraint = self._tool_choice(request)
        built, param = constraint is not None, "tools"  # built here: checked here
        if constraint is None:
            constraint = structured_outputs(request)
            param = "structured_outputs" if request.structured_outputs is not None else "response_format"
        elif request.structured_outputs is not None or request.response_format is not None:
            raise APIError(400, "tool_choice 'required' or a named function is enforced by a grammar, so it cannot "
                                "be combined with response_format or structured_outputs", "tool_choice")
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = functools.partial(self.reasoning_parser, prompt_opens)
            # The answer starts after the reasoning only when the text starts inside it.
            if constraint is not None and (prompt_opens or self.reasoning_parser.always_reasoning):
                constraint, built = _checked(lambda: after_reasoning(constraint, THINK_END), param), True
        if built:
            _checked(lambda: validate_structured_outputs(constraint), param)
        parsing = ChatParsing(reasoning, tool_parser, request.include_reasoning, not request.parallel_tool_calls,
                              named=isinstance(request.tool_choice, NamedToolChoice), tool_call_id=self.tool_call_id)
        return parsing, constraint

    def _tool_choice(self, request: ChatCompletionRequest):
        """(the tool parser factory or None, the constraint the tool choice enforces or None)."""
        choice = request.tool_choice or ("auto" if request.tools else "none")
        if choice != "none" and not request.tools:
            raise APIError(400, f"tool_choice={_choice_label(choice)} needs tools", "tool_choice")
        if choice == "none":
            return None, None
        functions = [t.function.model_dump(exclude_none=True) for t in request.tools]
        if choice == "auto":
            if self.tool_parser is None:
                raise APIError(400, AUTO_TOOLS_FLAGS, "tool_choice")
            return functools.partial(self.tool_parser, frozenset(f["name"] for f in functions)), None
        if choice == "required":
            schema = required_schema(functions, request.parallel_tool_calls)
            return RequiredParser, StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        named = [f for f in functions if f["name"] == choice.function.name]
        if not named:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                                f"({[f['name'] for f in functions]})", "tool_choice")
        schema = parameters_schema(named[0])
        return functools.partial(NamedParser, named[0]["name"]), StructuredOutputsParams(json=schema,
                                                                                        disable_any_whitespace=True)

    async def chat(self, request: ChatCompletionRequest, started) -> dict:
        """The whole ``chat.completion`` response of a non-streaming request."""
        request_id, created, ids, streams, parsing, params = started
        final = None
        async for _, out in merge(streams):
            final = out
        as_ids = request.return_tokens_as_token_ids
        choices = []
        for c in final.outputs:
            message, num_calls = parsing.message(c.text)
            message["role"] = self.role(request)
            choices.append({"index": c.index, "message": message,
                            "logprobs": (self._chat_logprobs(_output_rows(c, len(c.token_ids)), request.top_logprobs or 0,
                                                             as_ids=as_ids) if request.logprobs else None),
                            "finish_reason": parsing.finish_reason(c.finish_reason, num_calls),
                            "stop_reason": c.stop_reason})
        reasoning = (sum(self.reasoning_tokens(parsing, c.token_ids, params) for c in final.outputs)
                     if parsing.reasoning is not None else None)
        body = {"id": request_id, "object": "chat.completion", "created": created,
                "model": self.models.model_name(request.model), "choices": choices,
                "usage": _usage(len(ids), sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens,
                                reasoning)}
        if request.prompt_logprobs is not None:
            body["prompt_logprobs"] = _prompt_logprobs_body(final, request.prompt_logprobs)
        return body

    def reasoning_tokens(self, parsing: ChatParsing, token_ids: Sequence[int], params: SamplingParams) -> int:
        """Tokens of a choice's reasoning (0 without a reasoning parser), decoded as ``params`` decode them."""
        return reasoning_token_count(
            parsing, token_ids, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens))

    async def chat_stream(self, request: ChatCompletionRequest, started) -> AsyncIterator[bytes]:
        """The ``chat.completion.chunk`` chunks: a role chunk per choice, then its deltas, the last with its finish."""
        request_id, created, ids, streams, parsing, params = started
        include_usage, continuous = usage_options(request)
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.models.model_name(request.model)}

        def chunk(choice: dict, completion_tokens: int = 0) -> bytes:
            body = {**base, "choices": [choice]}
            if include_usage:
                body["usage"] = _usage(len(ids), completion_tokens, choices.num_cached_tokens) if continuous else None
            return _sse(body)

        choices = StreamedChoices(1, request.n)
        readers = [parsing.choice() for _ in range(request.n)]
        texts, token_ids = [""] * request.n, [[] for _ in range(request.n)]
        try:
            for i in range(request.n):
                yield chunk({"index": i, "delta": {"role": self.role(request), "content": ""}, "logprobs": None,
                             "finish_reason": None})
            async for _, index, _, _, c in choices.updates(merge(streams)):
                texts[index] += c.delta_text
                token_ids[index] += c.delta_token_ids
                logprobs = None
                if request.logprobs and c.delta_token_ids:
                    logprobs = self._chat_logprobs(_output_rows(c, len(c.delta_token_ids)), request.top_logprobs or 0,
                                                   as_ids=request.return_tokens_as_token_ids)
                deltas = readers[index].update(texts[index], final=c.finish_reason is not None) or [{}]
                finish = parsing.finish_reason(c.finish_reason, readers[index].num_calls)
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    yield chunk({"index": index, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                 "finish_reason": finish if last else None,
                                 "stop_reason": c.stop_reason if last and c.finish_reason else None},
                                choices.tokens(index))
            if include_usage:
                reasoning = (sum(self.reasoning_tokens(parsing, t, params) for t in token_ids)
                             if parsing.reasoning is not None else None)
                yield _sse({**base, "choices": [],
                            "usage": _usage(len(ids), choices.num_tokens, choices.num_cached_tokens, reasoning)})
        except Exception as e:
            yield _sse(stream_error(e))
        yield SSE_DONE

    def _chat_logprobs(self, rows: list[tuple[int, dict[int, Logprob]]], num_top: int, as_ids: bool = False) -> dict:
        """OpenAI's chat ``logprobs`` of ``rows``: per token text, logprob, UTF-8 bytes and the top ``num_top``."""

        def item(token_id: int, lp: Logprob, entry: dict[int, Logprob]) -> dict:
            text = self._token_text(token_id, entry)
            return {"token": _token_id_label(token_id) if as_ids else text, "logprob": lp.logprob,
                    "bytes": list(text.encode())}

        content = []
        for token_id, entry in rows:
            top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:num_top]
            content.append({**item(token_id, entry[token_id], entry),
                            "top_logprobs": [item(t, lp, entry) for t, lp in top]})
        return {"content": content}

    # ------------------------------------------------------------------ render

    def render_completion(self, request: CompletionRequest) -> list[dict]:
        """vLLM's ``POST /v1/completions/render``: the checked ``GenerateRequest`` body per prompt; nothing generated.

        Raises:
          APIError: what the completions route would answer.
        """
        prompts, params = self.completion_inputs(request)
        return [self._generate_request("cmpl", ids, p, request) for (_, ids), p in zip(prompts, params)]

    def render_chat_completion(self, request: ChatCompletionRequest) -> dict:
        """vLLM's ``POST /v1/chat/completions/render``: the checked ``GenerateRequest`` body; nothing generated.

        Raises:
          APIError: what the chat route would answer.
        """
        ids, _, params = self.chat_inputs(request)
        return self._generate_request("chatcmpl", ids, params, request)

    def _generate_request(self, prefix: str, ids: list[int], params: SamplingParams,
                          request: Union[CompletionRequest, ChatCompletionRequest]) -> dict:
        """vLLM's ``GenerateRequest`` body for one prompt, once the engine's own checks pass."""
        try:
            self.engine.input_processor.process(f"{prefix}-render", ids, params, priority=request.priority,
                                                cache_salt=request.cache_salt)
        except ValueError as e:
            raise _engine_refusal(e) from None
        stream_options = request.stream_options.model_dump() if request.stream_options is not None else None
        return {"request_id": f"{prefix}-{uuid.uuid4().hex}", "token_ids": ids, "features": None,
                "sampling_params": dataclasses.asdict(params), "model": request.model, "stream": request.stream,
                "stream_options": stream_options, "cache_salt": request.cache_salt, "priority": request.priority,
                "kv_transfer_params": None}

    # ------------------------------------------------------------------ tokenize

    def tokenize(self, request: TokenizeRequest) -> dict:
        """Token ids of a prompt, or of a conversation as chat completions render it.

        Raises:
          APIError: 400 naming the field (neither or both of ``prompt``/``messages``, chat fields with ``prompt``).
        """
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if request.messages is None:
            chat_only = [k for k in ("tools", "chat_template_kwargs") if getattr(request, k) is not None]
            if chat_only:
                raise APIError(400, f"{chat_only[0]} is for chat messages; a prompt is not rendered with the "
                                    "chat template", chat_only[0])
            self._need_tokenizer()
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        else:
            text = self.render_chat_text(request.messages, request.add_generation_prompt,
                                         request.continue_final_message, tool_dicts(request.tools),
                                         template_kwargs(self.options.default_chat_template_kwargs,
                                                         request.chat_template_kwargs))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def detokenize(self, tokens: list[int]) -> dict:
        """Text of token ids. Raises: APIError 400 (ids outside the vocabulary)."""
        self._need_tokenizer()
        vocab = self.engine.info.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(tokens)}


class StreamedChoices:
    """The choices of a streamed response as they change (vLLM's ``finish_reason_sent``): only news is yielded."""

    def __init__(self, num_prompts: int, n: int) -> None:
        self._n = n
        self._tokens: list[Optional[int]] = [None] * (num_prompts * n)  # None: nothing sent yet
        self._finished = [False] * (num_prompts * n)
        self._cached = [0] * num_prompts
        # Each prompt's logprob rows so far: DELTA outputs carry the rows recorded since the previous one, and
        # outputs without news for a choice (a prefill chunk's) are not yielded.
        self.prompt_logprobs: list[Optional[list[Optional[dict[int, Logprob]]]]] = [None] * num_prompts

    @property
    def num_tokens(self) -> int:
        """Completion tokens of every choice so far, each counted once (the usage's ``completion_tokens``)."""
        return sum(t or 0 for t in self._tokens)

    def tokens(self, index: int) -> int:
        """Completion tokens of choice ``index`` so far."""
        return self._tokens[index] or 0

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens read from the prefix cache, over every prompt (``prompt_tokens_details.cached_tokens``)."""
        return sum(self._cached)

    async def updates(self, outputs: AsyncIterator[tuple[int, RequestOutput]]
                      ) -> AsyncIterator[tuple[int, int, bool, RequestOutput, CompletionOutput]]:
        """(prompt index, choice index, first update?, request output, completion) of each choice with news, from
        DELTA outputs."""
        async for i, out in outputs:
            self._cached[i] = out.num_cached_tokens
            if out.prompt_logprobs:
                if self.prompt_logprobs[i] is None:
                    self.prompt_logprobs[i] = []
                self.prompt_logprobs[i] += out.prompt_logprobs
            for c in out.outputs:
                index = i * self._n + c.index
                if self._finished[index] or not (c.delta_text or c.delta_token_ids or c.finish_reason):
                    continue
                first = self._tokens[index] is None
                self._finished[index] = c.finish_reason is not None
                self._tokens[index] = self.tokens(index) + len(c.delta_token_ids)
                yield i, index, first, out, c


def _prompt_rows(token_ids: list[int], entries: Optional[list[Optional[dict[int, Logprob]]]], k: Optional[int]
                 ) -> list[tuple[int, Optional[dict[int, Logprob]]]]:
    """(token id, entry cut to the top ``k``) of a prompt's tokens (entries None when not asked for)."""
    return list(zip(token_ids, _top_k(entries, k) or [None] * len(token_ids)))


def _output_rows(c: CompletionOutput, count: int) -> list[tuple[int, Optional[dict[int, Logprob]]]]:
    """(token id, entry) of the last ``count`` generated tokens."""
    first = len(c.token_ids) - count
    return list(zip(c.token_ids[first:], (c.logprobs or [])[first:]))


def structured_outputs(request: Union[CompletionRequest, ChatCompletionRequest]) -> Optional[StructuredOutputsParams]:
    """The request's checked output constraint: vLLM's ``structured_outputs``, else OpenAI's ``response_format``.

    Raises:
      APIError: 400 naming ``structured_outputs`` or ``response_format``.
    """
    param = "structured_outputs" if request.structured_outputs is not None else "response_format"
    fmt = request.response_format
    try:
        if request.structured_outputs is not None:
            constraint = StructuredOutputsParams(**request.structured_outputs)
        elif fmt is None or fmt.type == "text":
            return None
        elif fmt.type == "json_object":
            constraint = StructuredOutputsParams(json_object=True)
        elif fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema", param)
        else:
            constraint = StructuredOutputsParams(json=fmt.json_schema.json_schema)
        validate_structured_outputs(constraint)
    except (TypeError, ValueError) as e:
        raise APIError(400, f"{e}".replace("SamplingParams.", ""), param) from None
    return constraint


def check_fields(endpoint: str, request: Any) -> None:
    """Apply ``field_policy``'s table to every field the request body set.

    Raises:
      APIError: 400 naming a field without a rule at ``endpoint``, or one whose value the table refuses.
    """
    refused = refusal(endpoint, request.given_fields())
    if refused is not None:
        raise APIError(400, refused.message, refused.param, refused.code)


def chat_template_kwargs(request: ChatCompletionRequest,
                         defaults: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """The chat template's extra variables as vLLM's ``build_chat_params`` gives them: ``chat_template_kwargs``,
    with the request's ``documents`` and ``reasoning_effort`` over them (and ``enable_thinking``, false for "none",
    unless ``chat_template_kwargs`` sets it), all over ``defaults`` (``--default-chat-template-kwargs``,
    :func:`template_kwargs`)."""
    given = request.chat_template_kwargs or {}
    fields: dict[str, Any] = {"documents": request.documents, "reasoning_effort": request.reasoning_effort}
    if request.reasoning_effort is not None and "enable_thinking" not in given:
        fields["enable_thinking"] = request.reasoning_effort != "none"
    return template_kwargs(defaults, _over(given, fields))


def _over(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` over ``base`` as vLLM's ``merge_kwargs``: an update of None or "auto" leaves ``base``'s value."""
    return {**base, **{k: v for k, v in update.items() if v is not None and v != "auto"}}


def template_kwargs(defaults: Optional[dict[str, Any]], given: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A request's chat template variables over the server's ``defaults``, as vLLM's renderer merges them: with
    defaults, a value of None or "auto" leaves the default in place; without, the request's stand as given. None
    when there are none."""
    merged = _over(defaults, given or {}) if defaults else dict(given or {})
    return merged or None


def check_combination(request: Union[CompletionRequest, ChatCompletionRequest]) -> None:
    """Refuse fields that cannot be honoured together (``stream_options``/``prompt_logprobs``/scoring vs ``stream``).

    Raises:
      APIError: 400 naming the field.
    """
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only for streamed responses: set stream=true or leave it out",
                       "stream_options")
    if request.prompt_logprobs is not None and request.stream:
        raise APIError(400, "prompt_logprobs are not available with stream=true", "prompt_logprobs")
    if scores_prompt(request) and request.stream:
        raise APIError(400, "max_tokens=0 (prompt scoring with echo) is not available with stream=true",
                       "max_tokens")
    if request.return_tokens_as_token_ids and (request.logprobs is None or request.logprobs is False):
        raise APIError(400, "return_tokens_as_token_ids spells the tokens of logprobs: it needs logprobs",
                       "return_tokens_as_token_ids")


def usage_options(request: Union[CompletionRequest, ChatCompletionRequest]) -> tuple[bool, bool]:
    """(a last usage chunk?, usage on every chunk?): ``continuous_usage_stats`` counts only with ``include_usage``
    (vLLM's ``should_include_usage``)."""
    options = request.stream_options
    include = options is not None and options.include_usage
    return include, include and options.continuous_usage_stats


def scores_prompt(request: Union[CompletionRequest, ChatCompletionRequest]) -> bool:
    """Whether the request only scores its prompt: a completion with ``echo`` and ``max_tokens: 0``."""
    return isinstance(request, CompletionRequest) and request.echo and request.max_tokens == 0


def score_response(c: CompletionOutput) -> CompletionOutput:
    """A prompt-scoring choice: the token the engine sampled after the prompt dropped, finished by its length."""
    return dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                               finish_reason="length", stop_reason=None, cumulative_logprob=None)


def _top_k(entries: Optional[list[Optional[dict[int, Logprob]]]],
           k: Optional[int]) -> Optional[list[Optional[dict[int, Logprob]]]]:
    """Prompt logprob entries cut to the prompt token and the top ``k``."""
    if entries is None or k is None:
        return entries
    return [None if e is None else {t: lp for i, (t, lp) in enumerate(e.items()) if i == 0 or lp.rank <= k}
            for e in entries]


def _output_kind(params: SamplingParams, request: Union[CompletionRequest, ChatCompletionRequest]) -> SamplingParams:
    """``params`` asking for the outputs the response is built from (vLLM's choice): a stream's chunks from each
    step's news (DELTA: no cumulative copy of a choice's text, tokens and logprobs a step), an unstreamed
    response from the final output only (FINAL_ONLY: no partial output is made)."""
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    return dataclasses.replace(params, output_kind=kind)


def _prompt_logprobs_body(out: RequestOutput, k: int) -> list[Optional[dict[str, dict]]]:
    """vLLM's ``prompt_logprobs``: None, then per token ``{"ID": {"logprob", "rank", "decoded_token"}}``."""
    return [None if e is None else {str(t): dataclasses.asdict(lp) for t, lp in e.items()}
            for e in _top_k(out.prompt_logprobs, k)]


def _token_id_label(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids`` spelling of a token."""
    return f"token_id:{token_id}"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
           reasoning_tokens: Optional[int] = None) -> dict:
    """OpenAI's ``usage``, with ``cached_tokens`` and (with a reasoning parser) ``reasoning_tokens``."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens,
             "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def check_parsers(tool_call_parser: Optional[str], enable_auto_tool_choice: bool,
                  reasoning_parser: Optional[str]) -> None:
    """Raises: ValueError naming the flag: an unknown parser, or auto tool choice without a parser (as vLLM)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {tool_call_parser}: unknown; choose from {sorted(TOOL_PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {reasoning_parser}: unknown; choose from {sorted(REASONING_PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{sorted(TOOL_PARSERS)})")


def _checked(make: Callable[[], Any], param: str) -> Any:
    """``make()``; its ValueError is a 400 naming ``param``."""
    try:
        return make()
    except ValueError as e:
        raise APIError(400, str(e).replace("SamplingParams.", ""), param) from None


def _choice_label(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{'function': {{'name': {choice.function.name!r}}}}}"


def tool_dicts(tools: Optional[list[ChatCompletionTool]]) -> Optional[list[dict]]:
    """A request's ``tools`` as the chat template reads them (OpenAI's dicts, HF's ``tools=``), or None."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _engine_refusal(error: ValueError) -> APIError:
    """The 400 for a request the engine refuses, naming ``priority``, ``cache_salt`` or ``prompt``."""
    message = str(error)
    param = next((name for name in ("priority", "cache_salt") if message.startswith(name)), "prompt")
    return APIError(400, message.replace("SamplingParams.", ""), param)


def stream_error(error: Exception) -> dict:
    """The error event a stream ends with when the engine fails mid-way (its status line was already sent)."""
    return {"error": {"message": str(error), "type": "server_error", "param": None, "code": None}}
