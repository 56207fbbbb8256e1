"""Request bodies of the OpenAI-compatible API (OpenAI's fields, vLLM's extras) as pydantic models, and errors.

Pydantic checks types and ``SamplingParams`` ranges, each a 400 naming the field. The three generation requests
declare the fields jaxllm honours and take any other as an extra, which ``field_policy.refusal`` judges (accepted
as advisory, or a 400 naming it); the other bodies refuse an undeclared field (``extra="forbid"``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Request(BaseModel):
    """A request body or part: undeclared fields refused; null for a field that takes None is None (completions'
    ``max_tokens: null`` is the room left, not the default 16), for any other its default (openai-python sends
    null for an argument given as None)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields or _takes_none(
            cls.model_fields[k].annotation)}


def _takes_none(annotation: Any) -> bool:
    return annotation is Any or type(None) in get_args(annotation)


class _PolicedRequest(_Request):
    """A generation request: fields not declared are kept in ``model_extra`` for ``field_policy.refusal``."""

    model_config = ConfigDict(extra="allow")

    def given_fields(self) -> dict[str, Any]:
        """Every field the body set (declared or not) -> its value, as ``field_policy.refusal`` reads them."""
        return {**{k: getattr(self, k) for k in self.model_fields_set}, **(self.model_extra or {})}


class StreamOptions(_Request):
    """``stream_options`` (only with ``stream: true``): ``include_usage`` adds a last chunk with the usage;
    with it, ``continuous_usage_stats`` adds each choice's usage so far to every chunk (vLLM's)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: OpenAI's named schema, always enforced (so ``strict`` holds either way)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class _SamplingFields(_PolicedRequest):
    """Fields completions and chat share, each mapped onto the ``SamplingParams`` field of the same name.

    ``logit_bias`` keys are token ids as strings; ``structured_outputs`` takes precedence over
    ``response_format``. vLLM's extras: ``priority`` (a 400 unless the policy reads it), ``cache_salt``,
    ``prompt_logprobs`` (not with ``stream``), ``return_tokens_as_token_ids``, ``truncate_prompt_tokens`` (keep
    the prompt's last k tokens, -1: ``max_model_len``) cutting on ``truncation_side`` (default left).
    """

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: Optional[str] = None
    prompt_logprobs: Optional[int] = None
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)
    truncation_side: Optional[Literal["left", "right"]] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` text(s) or token-id list(s); ``max_tokens`` default 16; ``echo`` with
    ``max_tokens: 0`` scores the prompt without generating.
    """

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    add_special_tokens: bool = True


class FunctionDefinition(_Request):
    """A tool's function: ``name``, ``description`` and the arguments' JSON schema ``parameters``."""

    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatCompletionTool(_Request):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    """The function a named ``tool_choice`` names."""

    name: str


class NamedToolChoice(_Request):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: the model calls that function."""

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: ``messages`` rendered with the chat template.

    ``max_tokens`` (or ``max_completion_tokens``) defaults to the room under ``max_model_len``;
    ``continue_final_message`` (with ``add_generation_prompt: false``) continues the last message.
    ``tool_choice``: "none", "auto" (read by ``--tool-call-parser``), "required" or a named function (both
    enforced by a grammar); ``include_reasoning: false`` drops the reasoning parser's ``reasoning``.
    ``reasoning_effort`` and ``documents`` reach the chat template as variables of those names (vLLM's), and
    ``reasoning_effort`` sets ``enable_thinking`` (false for "none") unless ``chat_template_kwargs`` does.
    """

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[ChatCompletionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    include_reasoning: bool = True
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    documents: Optional[list[dict[str, str]]] = None
    add_special_tokens: bool = False


class TokenizeRequest(_Request):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (vLLM's ``TokenizeChatRequest`` fields with them)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[ChatCompletionTool]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(_Request):
    """``POST /detokenize``: token ids to text."""

    model: Optional[str] = None
    tokens: list[int]


# HTTP status -> OpenAI's error ``type``.
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               409: "invalid_request_error",
               500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered with ``status`` and OpenAI's error body (:func:`error_body`)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


class ResponsesFunctionTool(_Request):
    """A ``/v1/responses`` tool: OpenAI's flat ``{"type": "function", "name", ...}``."""

    type: Literal["function"] = "function"
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ResponsesNamedToolChoice(_Request):
    """``tool_choice: {"type": "function", "name": ...}``."""

    type: Literal["function"] = "function"
    name: str


class ResponsesTextFormat(_Request):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (flat ``name``, ``schema``, ``strict``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponsesText(_Request):
    """``text``: the output's ``format``."""

    format: Optional[ResponsesTextFormat] = None


class ResponsesReasoning(_Request):
    """``reasoning``: ``effort`` reaches the chat template as chat's ``reasoning_effort``; jaxllm writes no
    ``summary``, so any is accepted."""

    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None


class ResponsesRequest(_PolicedRequest):
    """``POST /v1/responses``, the fields jaxllm honours of OpenAI's Responses API and vLLM's extras.

    ``input`` is a string or message/function-call items (``reasoning`` items accepted, not rendered);
    ``instructions`` is not carried over by ``previous_response_id``; ``store`` keeps the response in memory;
    ``include: ["message.output_text.logprobs"]`` fills each ``output_text``'s ``logprobs`` with ``top_logprobs``
    top tokens; ``truncation: "auto"`` drops the oldest prompt tokens to leave ``max_output_tokens`` (or one)
    under ``max_model_len``. The sampling fields are chat's.
    """

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[ResponsesFunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ResponsesNamedToolChoice]] = None
    parallel_tool_calls: bool = True
    text: Optional[ResponsesText] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    reasoning: Optional[ResponsesReasoning] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    include_reasoning: bool = True
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class UpdateWeightsFromDiskRequest(_Request):
    """``POST /update_weights_from_disk`` (SGLang's): load the checkpoint at ``model_path`` into the engine."""

    model_path: str


class AbortRequestsRequest(_Request):
    """``POST /abort_requests`` (vLLM's dev-mode RL route): ``request_ids`` to finish with "abort" (a response's id
    covers its requests, ``AsyncLLM.abort_in_flight``); None or empty: every open request. Other keys are ignored,
    as vLLM ignores them."""

    model_config = ConfigDict(extra="ignore")

    request_ids: Optional[list[str]] = None


class StartProfileRequest(BaseModel):
    """``POST /start_profile``'s optional body (vLLM's): one session's overrides (``LLMEngine.start_profile``);
    other keys are ignored, as vLLM ignores them, and values are not coerced."""

    model_config = ConfigDict(extra="ignore", strict=True)

    profile_prefix: Optional[str] = None
    delay_iterations: Optional[int] = None
    max_iterations: Optional[int] = None
    profiler_kwargs: Optional[dict[str, Any]] = None


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the PEFT folder ``lora_path`` as model ``lora_name``;
    ``load_inplace`` replaces an adapter already served under that name."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving adapter ``lora_name`` (vLLM's ``lora_int_id`` is
    accepted and not needed: the server names adapters by name)."""

    lora_name: str
    lora_int_id: Optional[int] = None
