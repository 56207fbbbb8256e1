"""``jaxllm serve [MODEL]``: the OpenAI-compatible HTTP server (FastAPI + uvicorn; vLLM's ``vllm serve``).

Routes: OpenAI's ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses``; vLLM's
``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``, the render routes, ``/tokenizer_info``, ``/version``,
``/debug/kv``; in dev mode (``JAXLLM_SERVER_DEV_MODE=1``) the weight and KV-pool routes (:func:`add_weight_routes`,
:func:`add_kv_pool_routes`); with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` true, vLLM's LoRA load / unload routes
(:func:`add_lora_routes`). The list, flags and behaviour: docs/serving/openai.md, docs/features/lora.md.

Errors carry OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 bad input (field and limit
named), 401 bad key, 404 unknown model or route, 503 queue full or asleep, 500 engine core died. A client that
disconnects aborts its requests. SIGTERM drains for up to ``--shutdown-timeout`` seconds, then exits 0. The
engine cores run in child processes (``MPClient``), one per ``--data-parallel-size``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import uuid
from typing import Any, Optional, Sequence, Union

import prometheus_client
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxllm import __version__
from jaxllm.core.client import EngineDeadError, QueueFullError
from jaxllm.entrypoints.openai.protocol import (
    AbortRequestsRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ResponsesRequest,
    StartProfileRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    error_body,
)
from jaxllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from jaxllm.entrypoints.openai.router_compat import RouterDefaults
from jaxllm.entrypoints.openai.serving import APIError, ServerOptions, check_parsers
from jaxllm.entrypoints.openai.serving_models import OpenAIServingModels, parse_lora_module, runtime_lora_updating
from jaxllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from jaxllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from jaxllm.frontend.front_end import EnginePausedError, EngineSleepingError
from jaxllm.logger import LEVELS, init_logger, logging_level
from jaxllm.paths import sampling_defaults

logger = init_logger(__name__)

DEFAULT_PORT = 8000
# Set to 1 to serve the weight and sleep routes (add_weight_routes), as vLLM's VLLM_SERVER_DEV_MODE: they let any
# client free the engine's memory or load a checkpoint from the server's disk.
DEV_MODE_VARIABLE = "JAXLLM_SERVER_DEV_MODE"


def build_parser(prog: str = "jaxllm serve") -> argparse.ArgumentParser:
    """The ``serve`` flags: the server's own, every ``EngineConfig`` field, then the rest of vLLM's
    (``jaxllm.entrypoints.vllm_flags``)."""
    from jaxllm.entrypoints.engine_args import add_engine_args
    from jaxllm.entrypoints.vllm_flags import Switch, add_vllm_flags

    # The usage line names no flag: there are some 370 (``--help`` lists them), and argparse repeats it before
    # every error.
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, usage="%(prog)s [MODEL] [flags]",
                                description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder, .gguf file, jaxllm orbax folder, named model (gemma3-270m, smollm2-135m-instruct) "
                        "or Hugging Face Hub id such as Qwen/Qwen3-0.6B (default: smollm2-135m-instruct)")
    p.add_argument("--config", metavar="FILE", help="a YAML file of flags (max_num_seqs: 64, as vLLM's --config); "
                                                    "flags on the command line win")
    p.add_argument("--config-model", help=argparse.SUPPRESS)  # a --config file's model (vllm_flags._yaml_flags)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (any of the keys given)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name clients send and see (default: the model as given, e.g. Qwen/Qwen3-0.6B, "
                        "or smollm2-135m-instruct for the default); several: each is accepted, the first is "
                        "the one metrics use")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight may take to finish after SIGTERM (default 30)")
    p.add_argument("--log-level", default=None, choices=LEVELS,
                   help="jaxllm's log level, the engine cores' too (default: JAXLLM_LOGGING_LEVEL, else info)")
    p.add_argument("--uvicorn-log-level", default="warning", choices=(*LEVELS, "trace"),
                   help="uvicorn's log level (default warning)")
    p.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a jinja2 chat template file (or the template itself, inline) used instead of the "
                        "model's, e.g. for a model that has none")
    p.add_argument("--enable-tokenizer-info-endpoint", action=Switch, default=False,
                   help="serve GET /tokenizer_info (the tokenizer's settings and chat template; off by default, as "
                        "in vLLM, since it shows the chat template)")
    p.add_argument("--enable-auto-tool-choice", action=Switch, default=False,
                   help="read the calls a model writes when tool_choice is 'auto' (needs --tool-call-parser); "
                        "without it, 'auto' with tools is refused")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes calls: hermes (Qwen2.5/3, Hermes), llama3_json, mistral, pythonic")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the model's <think> reasoning into message.reasoning: deepseek_r1, qwen3")
    p.add_argument("--lora-modules", nargs="+", default=None, type=parse_lora_module, metavar="MODULE",
                   help="LoRA adapters to serve (needs --enable-lora), each name=path or JSON {\"name\": .., "
                        "\"path\": .., \"base_model_name\": ..}; a request's model picks one by name")
    add_engine_args(p)
    add_vllm_flags(p)
    return p


def server_flags(args: argparse.Namespace) -> None:
    """Read vLLM's server flags that hold JSON or numbers (``--allowed-origins '["*"]'``,
    ``--default-chat-template-kwargs '{"enable_thinking": false}'``, ``--ssl-cert-reqs 2``) into their values, in
    place, and check the rest, so a bad one fails before the model loads. Raises ValueError naming the flag and
    the value, or a MODEL that several ``--served-model-name`` / ``--api-key`` values may have taken."""
    def parse(name: str, kind: type, default: Any) -> None:
        value = getattr(args, name)
        if value is None:
            setattr(args, name, default)
            return
        try:
            value = json.loads(value) if kind in (list, dict) else kind(value)
        except ValueError:
            value = None
        if not isinstance(value, kind):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)!r} must be "
                             f"{'a JSON ' if kind in (list, dict) else 'an '}{kind.__name__}")
        setattr(args, name, value)

    for name, kind, default in (("allowed_origins", list, []), ("allowed_methods", list, ["*"]),
                                ("allowed_headers", list, ["*"]), ("default_chat_template_kwargs", dict, {}),
                                ("override_generation_config", dict, {}), ("ssl_cert_reqs", int, None),
                                ("h11_max_incomplete_event_size", int, None)):
        parse(name, kind, default)
    if args.model is None:
        # A MODEL after a flag of several values is read as one more value (argparse's rule); vLLM refuses it too.
        several = [f"--{n.replace('_', '-')}" for n in ("served_model_name", "api_key") if len(getattr(args, n) or ()) > 1]
        if several:
            raise ValueError(f"{several[0]} took several values and no MODEL came before it: write "
                             f"'jaxllm serve MODEL {several[0]} ...', or give --model")
    args.generation_config = args.generation_config or "auto"
    from jaxllm.tokenizer import CONTENT_FORMATS

    args.chat_template_content_format = args.chat_template_content_format or "auto"
    if args.chat_template_content_format not in CONTENT_FORMATS:
        raise ValueError(f"--chat-template-content-format {args.chat_template_content_format!r} must be one of "
                         f"{CONTENT_FORMATS}")
    try:
        sampling_defaults(None, args.generation_config)
    except ValueError as e:
        raise ValueError(str(e).replace("generation_config=", "--generation-config ")) from None


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """``uvicorn.Config`` keywords of vLLM's server flags given (TLS, ``--uds``, ``--root-path``, the access log,
    ``--h11-max-incomplete-event-size``); the flags as :func:`server_flags` read them."""
    options = {name: getattr(args, name) for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs",
                                                      "ssl_ciphers", "uds", "root_path",
                                                      "h11_max_incomplete_event_size")
               if getattr(args, name) is not None}
    if args.disable_uvicorn_access_log:
        options["access_log"] = False
    return options


def add_http_flags(app: FastAPI, args: argparse.Namespace) -> None:
    """vLLM's CORS flags (when any is given: Starlette's ``CORSMiddleware``) and ``--enable-request-id-headers``
    (each response carries the request's ``X-Request-Id``, else a new one) on ``app``; the flags as
    :func:`server_flags` read them."""
    if args.allowed_origins or args.allow_credentials or args.allowed_methods != ["*"] or \
            args.allowed_headers != ["*"]:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                           allow_credentials=bool(args.allow_credentials), allow_methods=args.allowed_methods,
                           allow_headers=args.allowed_headers)
    if args.enable_request_id_headers:
        @app.middleware("http")
        async def request_id(request: Request, call_next):
            response = await call_next(request)
            response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            return response


def build_app(serving, api_key: Union[str, Sequence[str], None] = None, lifespan=None,
              enable_tokenizer_info: bool = False, docs: bool = True, profiling: bool = False):
    """The FastAPI app over an ``OpenAIServing`` (``api_key``: the key, or keys, a /v1 request must bear;
    ``lifespan``: FastAPI's, to stop the engine at shutdown; ``docs`` False: no /docs, /redoc or /openapi.json,
    vLLM's ``--disable-fastapi-docs``; ``profiling``: serve ``/start_profile`` and ``/stop_profile``, which the
    engine's ``profiler_config`` must allow)."""
    engine = serving.engine
    app = FastAPI(title="jaxllm", version=__version__, lifespan=lifespan,
                  **({} if docs else dict(docs_url=None, redoc_url=None, openapi_url=None)))

    def error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
        return JSONResponse(error_body(status, message, param, code), status_code=status)

    add_error_handlers(app, error)

    if api_key is not None:
        bearers = {f"Bearer {key}" for key in ([api_key] if isinstance(api_key, str) else api_key)}

        @app.middleware("http")
        async def check_key(request: Request, call_next):
            if request.url.path.startswith("/v1") and request.headers.get("authorization") not in bearers:
                return error(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'.", None,
                             "invalid_api_key")
            return await call_next(request)

    async def respond(request: Request, body, prepare, full, stream):
        started = prepare(body)
        if body.stream:
            return StreamingResponse(stream(body, started), media_type="text/event-stream")
        return JSONResponse(await until_disconnected(request, full(body, started)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(request, body, serving.prepare_completion, serving.completion, serving.completion_stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(request, body, serving.prepare_chat, serving.chat, serving.chat_stream)

    @app.get("/v1/models")
    async def models():
        return serving.models.show_available_models()

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return error(503, f"the engine died: {engine.dead}", None, "engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus_client.generate_latest(engine.metrics.registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.get("/debug/kv")
    async def debug_kv(core: int = 0, block_map: bool = True):
        try:
            return await engine.kv_cache_report(core, block_map)
        except ValueError as e:
            raise APIError(400, str(e), "core") from None

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        return serving.detokenize(body.tokens)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    add_worker_parts(app, serving, enable_tokenizer_info)
    add_render_routes(app, serving)
    add_responses_routes(app, OpenAIServingResponses(serving), respond)
    if os.environ.get(DEV_MODE_VARIABLE) == "1":
        add_weight_routes(app, engine)
        add_pause_routes(app, engine)
        add_kv_pool_routes(app, engine)
    if runtime_lora_updating():
        add_lora_routes(app, serving)
    if profiling:
        add_profile_routes(app, engine)
    return app


def add_error_handlers(app: FastAPI, error) -> None:
    """OpenAI's error body for every failure: a refused value or field (400, named), full queue (503), dead
    engine (500)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return error(400, f"the body is not valid JSON: {first.get('msg')}", None, "json_invalid")
        where = ".".join(loc) or "body"
        if first.get("type") == "extra_forbidden":
            return error(400, f"{where}: jaxllm does not support this field, and refuses it rather than ignore it",
                         loc[0] if loc else None, "unsupported_field")
        return error(400, f"{where}: {first.get('msg')} (got {first.get('input')!r})", loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error(e.status_code, str(e.detail))

    @app.exception_handler(QueueFullError)
    async def queue_full(_: Request, e: QueueFullError) -> JSONResponse:
        return error(503, str(e), None, "queue_full")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error(500, f"the engine died: {e}", None, "engine_dead")


def add_worker_parts(app, serving, enable_tokenizer_info: bool) -> None:
    """What a router's worker needs beyond the OpenAI routes: the router's default fields accepted
    (``router_compat.RouterDefaults``), and ``GET /tokenizer_info`` when enabled."""
    app.add_middleware(RouterDefaults)
    if enable_tokenizer_info:
        add_tokenizer_info_route(app, serving)


def add_render_routes(app: FastAPI, serving) -> None:
    """vLLM's render routes (a request's prompt token ids, without generating): ``POST /v1/completions/render``
    (one body per prompt) and ``POST /v1/chat/completions/render``; checked as the generation routes check."""

    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest):
        return serving.render_completion(body)

    @app.post("/v1/chat/completions/render")
    async def render_chat_completion(body: ChatCompletionRequest):
        return serving.render_chat_completion(body)


def add_tokenizer_info_route(app, serving) -> None:
    """``GET /tokenizer_info`` (``--enable-tokenizer-info-endpoint``): vLLM's body
    (``jaxllm.tokenizer.Tokenizer.info``); 400 for a model without a tokenizer."""

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        if serving.tokenizer is None:
            raise APIError(400, f"{serving.model_name} has no tokenizer (it takes token-id prompts)")
        return serving.tokenizer.info()


def add_responses_routes(app: FastAPI, responses: OpenAIServingResponses, respond) -> None:
    """``POST /v1/responses`` (streamed or whole) and ``GET /v1/responses/{id}``."""

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await respond(request, body, responses.prepare, responses.create, responses.stream)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return responses.retrieve(response_id)


def add_weight_routes(app, engine) -> None:
    """vLLM's dev-mode ``/sleep`` (query ``level``, ``mode``, ``reset_connector``), ``/wake_up`` (query ``tags``),
    ``/release_kv_cache_memory`` (after a level-0 sleep), ``/is_sleeping``, ``/reset_prefix_cache`` and SGLang's
    ``/update_weights_from_disk``, over an ``AsyncLLM``: 400 for a ValueError, 409 for a RuntimeError, naming why."""

    @app.exception_handler(EngineSleepingError)
    async def sleeping(_: Request, e: EngineSleepingError) -> JSONResponse:
        return JSONResponse(error_body(503, str(e), None, "engine_sleeping"), status_code=503)

    @app.post("/sleep")
    async def sleep(level: int = 1, mode: str = "abort", reset_connector: bool = True):
        reports = await _refused_as_api_errors(engine.sleep(level, mode, reset_connector))
        return {"status": "sleeping", "level": level, "cores": reports}

    @app.post("/wake_up")
    async def wake_up(tags: Optional[list[str]] = Query(None)):
        awake = await _refused_as_api_errors(engine.wake_up(tags))
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @app.post("/release_kv_cache_memory")
    async def release_kv_cache_memory(reset_connector: bool = True):
        await _refused_as_api_errors(engine.release_kv_cache_memory(reset_connector))
        return {"status": "kv_cache_released"}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": await _refused_as_api_errors(engine.is_sleeping())}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
        success = await _refused_as_api_errors(engine.reset_prefix_cache(reset_running_requests, reset_external))
        return {"success": bool(success)}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
        report = await _refused_as_api_errors(engine.update_weights_from_path(body.model_path))
        return {"success": True, "message": f"updated {report['num_leaves']} weights from {body.model_path}",
                **report}


def add_lora_routes(app, serving) -> None:
    """vLLM's ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path, load_inplace?}`` and
    ``POST /v1/unload_lora_adapter`` ``{lora_name}`` (served when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true),
    answering vLLM's plain-text success message; errors as ``OpenAIServingModels`` raises them."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        message = await serving.models.load_lora_adapter(body.lora_name, body.lora_path,
                                                         load_inplace=body.load_inplace)
        return PlainTextResponse(message)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return PlainTextResponse(await serving.models.unload_lora_adapter(body.lora_name))


def add_kv_pool_routes(app, engine) -> None:
    """Dev mode: ``POST /kv_cache/compact`` and ``POST /kv_cache/resize?num_blocks=N`` (``AsyncLLM``'s), each
    answering ``{"cores": [report per core]}``; 400 for a refused resize (pool unchanged), 409 while asleep."""

    @app.post("/kv_cache/compact")
    async def kv_cache_compact():
        return {"cores": await _refused_as_api_errors(engine.kv_cache_compact())}

    @app.post("/kv_cache/resize")
    async def kv_cache_resize(num_blocks: int):
        return {"cores": await _refused_as_api_errors(engine.kv_cache_resize(num_blocks))}


def add_pause_routes(app, engine) -> None:
    """vLLM's dev-mode RL routes over an ``AsyncLLM``: ``/pause`` (query ``mode``, ``clear_cache``, and older
    vLLM's ``wait_for_inflight_requests``), ``/resume``, ``/is_paused``, ``/abort_requests`` (body
    ``{"request_ids": [...]}``, none or empty: all) and ``/get_world_size``, with vLLM's bodies; 400 naming a bad
    mode; a request refused while paused is a 503."""

    @app.exception_handler(EnginePausedError)
    async def paused(_: Request, e: EnginePausedError) -> JSONResponse:
        return JSONResponse(error_body(503, str(e), None, "engine_paused"), status_code=503)

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True, wait_for_inflight_requests: Optional[bool] = None):
        await _refused_as_api_errors(engine.pause_generation(mode=mode, clear_cache=clear_cache,
                                                             wait_for_inflight_requests=wait_for_inflight_requests))
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        await _refused_as_api_errors(engine.resume_generation())
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": await engine.is_paused()}

    @app.post("/abort_requests")
    async def abort_requests(body: AbortRequestsRequest):
        return {"status": "aborted", "aborted": await engine.abort_in_flight(body.request_ids)}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True):
        parallel = engine.config.parallel
        return {"world_size": parallel.tensor_parallel_size * (parallel.data_parallel_size if include_dp else 1)}


def add_profile_routes(app, engine) -> None:
    """vLLM's ``/start_profile`` (an optional ``StartProfileRequest`` body) and ``/stop_profile``, over an
    ``AsyncLLM`` whose ``profiler_config`` names a profiler: 200 with no body; 400 for a bad override, 409 for a
    session already active (both named)."""
    logger.warning("profiling routes /start_profile and /stop_profile are served (profiler_config): any client can "
                   "record traces; use them for local development only")

    @app.post("/start_profile")
    async def start_profile(body: Optional[StartProfileRequest] = None):
        overrides = body.model_dump(exclude_none=True) if body is not None else {}
        prefix = overrides.pop("profile_prefix", None)
        await _refused_as_api_errors(engine.start_profile(prefix, **overrides))
        return Response(status_code=200)

    @app.post("/stop_profile")
    async def stop_profile():
        await _refused_as_api_errors(engine.stop_profile())
        return Response(status_code=200)


async def _refused_as_api_errors(work) -> Any:
    """Await an engine call, a ValueError as a 400 APIError, a RuntimeError as 409; EngineDeadError stays (500)."""
    try:
        return await work
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except RuntimeError as e:
        if isinstance(e, EngineDeadError):
            raise
        raise APIError(409, str(e), None, "conflict") from None


async def until_disconnected(request, work) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (its requests are aborted) and return None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: a free port), for uvicorn to listen on. Bound before the model
    loads, as vLLM's server binds, so that a taken address fails at once rather than after start-up.

    Raises:
      ValueError: the address cannot be bound (taken, not this machine's, or a name that does not resolve), named
        with the OS's reason.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"--host {host!r}: {e.strerror or e}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        # Listening now holds the port against a second server started meanwhile (a bound socket alone does not,
        # under SO_REUSEADDR); uvicorn listens on it again, which changes nothing.
        sock.listen()
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); another "
                         "server may hold it, so choose another --port") from None
    return sock


def run(args: argparse.Namespace) -> int:
    """Start the engine cores, then serve until SIGTERM or Ctrl-C; returns the exit status."""
    # Before anything slow: the address (--uds: uvicorn binds the path itself).
    sock = None if args.uds else listen_socket(args.host, args.port)
    try:
        return _serve(args, sock)
    finally:
        if sock is not None:
            sock.close()


def _serve(args: argparse.Namespace, sock: Optional[socket.socket]) -> int:
    """:func:`run` once the address is held (``sock``; None with ``--uds``)."""
    import uvicorn

    from jaxllm.frontend.async_llm import AsyncLLM
    from jaxllm.named_models import DEFAULT_MODEL, resolve_model
    from jaxllm.entrypoints.engine_args import engine_kwargs
    from jaxllm.entrypoints.vllm_flags import set_hf_token
    from jaxllm.entrypoints.openai.serving import OpenAIServing
    from jaxllm.paths import model_format
    from jaxllm.tokenizer import load_named_tokenizer, load_tokenizer

    set_hf_token(args.hf_token)
    model = str(resolve_model(args.model, args.revision, args.download_dir))
    model_format(model)
    served_model_name, *aliases = args.served_model_name or [args.model or DEFAULT_MODEL]
    kwargs = engine_kwargs(args)
    source = kwargs.pop("tokenizer")
    revision = args.tokenizer_revision or args.revision
    tokenizer = (load_named_tokenizer(source, revision, args.download_dir) if source is not None
                 else load_tokenizer(model))
    if args.chat_template is not None:
        if tokenizer is None:
            raise ValueError(f"--chat-template: {model} has no tokenizer, so it cannot render chats")
        tokenizer.set_chat_template(args.chat_template)
    engine = AsyncLLM(model, tokenizer=tokenizer, served_model_name=served_model_name, **kwargs)
    models = OpenAIServingModels(engine, served_model_name, args.model or served_model_name,
                                 engine.info.max_model_len, tuple(args.lora_modules or ()), tuple(aliases))
    try:
        asyncio.run(models.init_static_loras())
    except BaseException:
        engine.client.shutdown()
        raise
    options = ServerOptions(response_role=args.response_role or "assistant",
                            return_tokens_as_token_ids=bool(args.return_tokens_as_token_ids),
                            enable_force_include_usage=bool(args.enable_force_include_usage),
                            default_chat_template_kwargs=args.default_chat_template_kwargs,
                            enable_log_requests=bool(args.enable_log_requests),
                            exclude_tools_when_tool_choice_none=bool(args.exclude_tools_when_tool_choice_none),
                            chat_template_content_format=args.chat_template_content_format)
    defaults = sampling_defaults(model, args.generation_config, args.override_generation_config)
    if defaults and args.generation_config != "vllm":
        logger.warning(f"requests that leave them out run with {defaults}, from the generation_config.json of "
                       f"{'the model' if args.generation_config == 'auto' else args.generation_config} "
                       "(as vLLM's); --generation-config vllm leaves them out")
    serving = OpenAIServing(engine, served_model_name, defaults,
                            tool_call_parser=args.tool_call_parser,
                            enable_auto_tool_choice=args.enable_auto_tool_choice,
                            reasoning_parser=args.reasoning_parser, models=models, options=options)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        engine.shutdown()

    profiler = engine.config.observability.profiler_config
    profiling = profiler is not None and profiler.profiler is not None
    app = build_app(serving, args.api_key, lifespan, args.enable_tokenizer_info_endpoint,
                    docs=not args.disable_fastapi_docs, profiling=profiling)
    add_http_flags(app, args)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=5,
                            **uvicorn_options(args))
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; with these handlers
    # that ends here, and the process exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    if args.advisory_flags:
        logger.info("vLLM flags accepted without effect: " + "; ".join(args.advisory_flags))
    port = args.port if sock is None else sock.getsockname()[1]
    where = f"unix:{args.uds}" if args.uds else f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{port}"
    logger.info(f"serving {serving.model_name} ({model}) on {where} (OpenAI-compatible API under /v1)")
    try:
        server.run(sockets=None if sock is None else [sock])
    finally:
        engine.client.shutdown()
    return 0


def main(argv: Optional[Sequence[str]] = None, prog: str = "jaxllm serve") -> int:
    """Parse ``argv`` and serve; returns the exit status: 0, or 2 for a bad flag or model (one line on stderr)."""
    from jaxllm.entrypoints.engine_args import check_engine_args

    from jaxllm.entrypoints.vllm_flags import apply_vllm_flags, normalize_argv

    parser = build_parser(prog)
    try:
        args = parser.parse_args(normalize_argv(parser, sys.argv[1:] if argv is None else argv))
        args.advisory_flags = apply_vllm_flags(args)
        server_flags(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problem = check_engine_args(args)
    if args.lora_modules and not args.enable_lora:
        problem = "--lora-modules needs --enable-lora"
    try:
        check_parsers(args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser)
    except ValueError as e:
        problem = str(e)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        if args.chat_template is not None:
            from jaxllm.tokenizer import compile_chat_template, read_chat_template

            # Read and checked before the model loads, as the other flags are; run() takes the template itself.
            args.chat_template = read_chat_template(args.chat_template)
            compile_chat_template(args.chat_template)
        with logging_level(args.log_level, "info"):
            return run(args)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2



if __name__ == "__main__":
    sys.exit(main())
