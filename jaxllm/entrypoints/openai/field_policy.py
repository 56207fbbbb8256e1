"""What jaxllm does with each request field vLLM's request models declare, per endpoint: the one table.

Every field of vLLM's ``CompletionRequest``, ``ChatCompletionRequest`` and ``ResponsesRequest`` (vLLM 0.33's
``vllm/entrypoints/openai/{completion,chat_completion,responses}/protocol.py``), and the OpenAI fields vLLM
accepts without declaring them (``store``, ``metadata``, ``service_tier``, ``prompt_cache_key`` on chat), has a
:class:`Rule` here:

- ``honoured``: the handler reads the field and its value changes what the request does or returns;
- ``advisory``: accepted and not acted on, as vLLM does, because no value changes what jaxllm returns;
- either kind may refuse some values (``refuses``): those whose loss would change what the client gets, each a 400
  naming the field (vLLM refuses them too, or does something jaxllm does not implement).

A field given to an endpoint without a rule is refused with a 400 naming it (``unsupported_field``): vLLM would
ignore it, and jaxllm does not ignore a field silently. :func:`refusal` applies the table; the request models
(``protocol.py``) declare the honoured fields with their types and take the others as extras.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

HONOURED = "honoured"
ADVISORY = "advisory"


def _never(_: Any) -> bool:
    return False


def _truthy(value: Any) -> bool:
    return bool(value)


def _given(value: Any) -> bool:
    return value is not None


@dataclasses.dataclass(frozen=True)
class Rule:
    """One field's decision: ``kind`` (``HONOURED`` or ``ADVISORY``), ``reason`` (why, and for a refused value the
    400's explanation) and ``refuses`` (a predicate on the JSON value: True for the values refused)."""

    kind: str
    reason: str
    refuses: Callable[[Any], bool] = _never


def honoured(reason: str, refuses: Callable[[Any], bool] = _never) -> Rule:
    return Rule(HONOURED, reason, refuses)


def advisory(reason: str, refuses: Callable[[Any], bool] = _never) -> Rule:
    return Rule(ADVISORY, reason, refuses)


# Fields completions and chat share (vLLM declares them on both).
_SAMPLING = {name: honoured("a SamplingParams field of the same name") for name in (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "stop", "stop_token_ids", "logit_bias", "ignore_eos", "min_tokens", "skip_special_tokens",
    "include_stop_str_in_output", "allowed_token_ids", "bad_words", "prompt_logprobs")}
_COMMON = {
    **_SAMPLING,
    "model": honoured("checked against --served-model-name (404 for another)"),
    "stream": honoured("server-sent events"),
    "stream_options": honoured("include_usage: a last usage chunk; continuous_usage_stats: usage on every chunk"),
    "response_format": honoured("enforced by a grammar"),
    "structured_outputs": honoured("enforced by a grammar"),
    "priority": honoured("the scheduling priority (400 unless --scheduling-policy reads it)"),
    "cache_salt": honoured("salts the prefix-cache hash of the first block: no blocks shared across salts"),
    "return_tokens_as_token_ids": honoured("logprob tokens spelt token_id:ID"),
    "truncate_prompt_tokens": honoured("keeps the prompt's last k tokens (-1: max_model_len)"),
    "truncation_side": honoured("which end truncate_prompt_tokens cuts"),
    "add_special_tokens": honoured("the tokenizer's special tokens (BOS) added to the prompt"),
    "user": advisory("an end-user id for the provider's abuse monitoring; changes no output"),
    "request_id": advisory("jaxllm names each engine request itself (unique per choice)"),
    "session_id": advisory("a routing hint; one jaxllm server routes by prompt prefix"),
    "length_penalty": honoured("with use_beam_search: beams rank by cumulative logprob / length ** length_penalty; "
                               "without it, read by nothing (as vLLM)"),
    "stream_interval": advisory("how many tokens a chunk groups; the streamed text and usage are the same"),
    "routed_experts_prompt_start": advisory("only shapes returned routed experts, which jaxllm never returns"),
    "mm_payload": advisory("multimodal inputs only; jaxllm serves text models"),
    "use_beam_search": honoured("n beams (jaxllm.beam_search), the best first; penalties, stops and bias do not "
                                "apply to beams (as vLLM); not with logprobs, prompt logprobs, a structured output "
                                "or allowed_token_ids"),
    "watermarking": advisory("watermarking is not implemented", _truthy),
    "spaces_between_special_tokens": advisory(
        "jaxllm's detokenizer (a fast tokenizer's, as vLLM's fast path) puts no spaces between special tokens"),
    "logprob_token_ids": advisory("logprobs of chosen token ids are not implemented", _truthy),
    "prompt_embeds": advisory("prompt embeddings as input are not implemented", _given),
    "return_token_ids": advisory("token ids in the response are not implemented", _truthy),
    "return_weight_versions": advisory("weight versions in the response are not implemented", _truthy),
    "return_token_offsets": advisory("character offsets in the response are not implemented", _truthy),
    "return_mm_kwargs": advisory("multimodal kwargs in the response are not implemented", _truthy),
    "kv_transfer_params": advisory("disaggregated prefill (KV transfer) is not implemented", _given),
    "ec_transfer_params": advisory("encoder-cache transfer is not implemented", _given),
    "vllm_xargs": advisory("custom logits-processor arguments are not implemented", _truthy),
    "repetition_detection": advisory("repetition detection is not implemented", _given),
    "thinking_token_budget": advisory("a reasoning token budget is not implemented", _given),
}

COMPLETIONS = {
    **_COMMON,
    "prompt": honoured("text(s) or token-id list(s)"),
    "max_tokens": honoured("default 16; null: the room left under max_model_len"),
    "logprobs": honoured("the top logprobs of each generated token"),
    "echo": honoured("the prompt before the completion (with max_tokens 0: prompt scoring)"),
    "suffix": advisory("fill-in-the-middle is not implemented", _truthy),
}

CHAT = {
    **_COMMON,
    "messages": honoured("rendered with the chat template"),
    "max_tokens": honoured("default: the room left under max_model_len"),
    "max_completion_tokens": honoured("max_tokens' newer name; wins over it"),
    "logprobs": honoured("the logprobs of each generated token"),
    "top_logprobs": honoured("top tokens per logprob entry"),
    "tools": honoured("rendered by the chat template"),
    "tool_choice": honoured("none, auto (--tool-call-parser), required or named (grammar)"),
    "parallel_tool_calls": honoured("false: at most one call"),
    "include_reasoning": honoured("false: the reasoning parser's text dropped"),
    "reasoning_effort": honoured("the chat template's reasoning_effort, and enable_thinking unless 'none' "
                                 "(unless chat_template_kwargs sets enable_thinking)"),
    "add_generation_prompt": honoured("the template's assistant cue"),
    "continue_final_message": honoured("continues the last message"),
    "documents": honoured("the chat template's documents"),
    "chat_template_kwargs": honoured("extra chat template variables"),
    "chat_template": advisory("a request's own chat template is refused (vLLM's default without "
                              "--trust-request-chat-template): give --chat-template", _given),
    "echo": advisory("echoing the last message is not implemented", _truthy),
    "return_prompt_text": advisory("the prompt text in the response is not implemented", _truthy),
    "media_io_kwargs": advisory("multimodal inputs only; jaxllm serves text models"),
    "mm_processor_kwargs": advisory("multimodal inputs only; jaxllm serves text models"),
    "store": advisory("OpenAI's stored completions; vLLM ignores it too"),
    "metadata": advisory("tags for OpenAI's stored completions; changes no output"),
    "service_tier": advisory("one tier of service"),
    "safety_identifier": advisory("an end-user id for the provider's abuse monitoring; changes no output"),
    "prompt_cache_key": advisory("a cache-routing hint; jaxllm's prefix cache matches by content already"),
}

_INCLUDABLE = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
               "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
               "web_search_call.action.sources", "web_search_call.results")


def _bad_include(value: Any) -> bool:
    return bool(value) and any(item not in _INCLUDABLE for item in value)


RESPONSES = {
    **{name: CHAT[name] for name in ("model", "stream", "priority", "cache_salt", "tools", "tool_choice",
                                     "parallel_tool_calls", "include_reasoning", "structured_outputs",
                                     "chat_template_kwargs", "user", "request_id", "session_id", "mm_payload",
                                     "media_io_kwargs", "mm_processor_kwargs", "safety_identifier",
                                     "prompt_cache_key", "service_tier", "watermarking",
                                     "spaces_between_special_tokens", "return_mm_kwargs", "kv_transfer_params",
                                     "ec_transfer_params", "vllm_xargs")},
    **{name: _SAMPLING[name] for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                          "frequency_penalty", "repetition_penalty", "seed", "stop",
                                          "stop_token_ids", "logit_bias", "ignore_eos", "skip_special_tokens",
                                          "include_stop_str_in_output")},
    "input": honoured("a string or message, function_call, function_call_output and reasoning items"),
    "instructions": honoured("the system message"),
    "max_output_tokens": honoured("the response's max_tokens"),
    "text": honoured("text.format: json_object or json_schema, enforced by a grammar"),
    "store": honoured("true: kept in memory for previous_response_id and GET /v1/responses/{id}"),
    "previous_response_id": honoured("continues a stored response's conversation"),
    "metadata": honoured("echoed in the response"),
    "include": honoured("message.output_text.logprobs fills output_text logprobs; the other items name outputs "
                        "of hosted tools jaxllm never produces, so there is nothing to include",
                        _bad_include),
    "top_logprobs": honoured("top tokens per output_text logprob (with include message.output_text.logprobs)"),
    "reasoning": honoured("reasoning.effort as chat's reasoning_effort; summary: jaxllm writes no summaries"),
    "truncation": honoured("disabled: a prompt over max_model_len is a 400; auto: the oldest prompt tokens "
                           "dropped to fit"),
    "max_tool_calls": advisory("bounds calls to built-in (hosted) tools, which jaxllm does not run: no response "
                               "exceeds it"),
    "prompt_cache_options": advisory("prompt caching is automatic"),
    "prompt_cache_retention": advisory("prompt caching is automatic"),
    "background": advisory("background responses are not implemented", _truthy),
    "prompt": advisory("prompt templates are not supported (vLLM refuses them too)", _given),
    "enable_response_messages": advisory("raw response messages (gpt-oss harmony) are not implemented", _truthy),
    "previous_input_messages": advisory("harmony input messages are not implemented", _truthy),
}

TABLE: dict[str, dict[str, Rule]] = {"completions": COMPLETIONS, "chat": CHAT, "responses": RESPONSES}


class Refusal(NamedTuple):
    """A 400's ``message``, ``param`` (the field) and ``code``."""

    message: str
    param: str
    code: Optional[str]


def refusal(endpoint: str, given: dict[str, Any]) -> Optional[Refusal]:
    """The first refusal among the fields ``given`` to ``endpoint`` (field -> JSON value), or None.

    A field without a rule is ``unsupported_field``; a value the rule refuses names the field and the reason.
    """
    rules = TABLE[endpoint]
    for name, value in given.items():
        rule = rules.get(name)
        if rule is None:
            return Refusal(f"{name}: jaxllm does not support this field, and refuses it rather than ignore it",
                           name, "unsupported_field")
        if rule.refuses(value):
            return Refusal(f"{name}={value!r:.100}: {rule.reason}", name, None)
    return None
