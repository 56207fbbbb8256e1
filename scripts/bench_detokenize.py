"""Detokenizing a generated sequence on the default model's tokenizer, as the front end does it.

Times, in milliseconds (median of ``--repeats``): one read of the backend's vocabulary size (what tokenizers 0.22
rebuilds the vocabulary for), the incremental detokenizer over ``--tokens`` ids, and the same with logprob texts
(``SamplingParams(logprobs=5)``: each position's top tokens decoded in context too). Run it under each tokenizers
version to compare; ``--result-file MACHINE`` adds the run as a row of the dated result file
``docs/benchmarks/results/<date>-<MACHINE>-detokenize.json`` (created, or extended by a later run the same day) and
renders its Markdown page (``scripts/render_results.py``).

    python scripts/bench_detokenize.py [--model PATH] [--tokens 64] [--repeats 5] [--result-file MACHINE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _bench_common as common  # noqa: E402
import render_results  # noqa: E402

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
        "red ball. One day, she met a small dog who wanted to play too. They ran and laughed until the sun went "
        "down, and then they walked home together, happy and tired. ")
COLUMNS = ["tokenizers", "vocabulary", "tokens", "get_vocab_size ms", "detokenize ms", "with logprob texts ms"]


def _sequence(tokenizer, num_tokens: int) -> list[int]:
    """``num_tokens`` ids of ``TEXT`` repeated (a generated sequence of ordinary text)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(model: str, num_tokens: int, repeats: int) -> dict:
    """The three timings (ms) and what they were taken on."""
    import tokenizers

    from jaxllm.core.messages import EngineCoreOutput, EngineCoreRequest, SampleLogprobs
    from jaxllm.frontend.output_processor import OutputProcessor
    from jaxllm.tokenizer import IncrementalDetokenizer, load_tokenizer
    from scheduler import SamplingParams

    tokenizer = load_tokenizer(model)
    ids = _sequence(tokenizer, num_tokens)
    prompt = tokenizer.encode("Tell me a story.")

    def detokenize() -> None:
        detok = IncrementalDetokenizer(tokenizer, prompt)
        for token in ids:
            detok.step(token)
        assert detok.text == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]

    def with_logprobs() -> None:
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(logprobs=5, max_tokens=None)
        processor.add_request(EngineCoreRequest("r", prompt, params, [0], [], [], tokenizer.eos_token_id, 0.0), None)
        for k, token in enumerate(ids):
            row = SampleLogprobs(token, -1.0, 1, ids[:5], [-1.0] * 5)
            processor.process_outputs([EngineCoreOutput("r", 0, [token], new_logprobs=[row],
                                                        finish_reason="length" if k == len(ids) - 1 else None)])

    return {"tokenizers": tokenizers.__version__, "vocabulary": tokenizer.vocab_size, "tokens": len(ids),
            "get_vocab_size_ms": _median_ms(lambda: tokenizer.backend.get_vocab_size(with_added_tokens=True),
                                            repeats),
            "detokenize_ms": _median_ms(detokenize, repeats), "with_logprobs_ms": _median_ms(with_logprobs, repeats)}


def add_to_result_file(machine: str, row: dict, command: str, host: dict) -> str:
    """Add ``row`` to today's result file for ``machine`` (created when missing) and render its page; its path."""
    date = datetime.date.today().isoformat()
    path = render_results.RESULTS / f"{date}-{machine}-detokenize.json"
    result = json.loads(path.read_text()) if path.exists() else {
        "date": date, "machine": machine, "title": "Detokenizing a sequence on the default model's tokenizer",
        "host": host,
        "description": "Milliseconds, medians of repeated runs: one read of the tokenizer's vocabulary size (which "
                       "tokenizers 0.22 rebuilds the vocabulary for; jaxllm reads it once at load), the incremental "
                       "detokenizer over the sequence, and the same with logprob texts (top 5 per position).",
        "tables": [{"title": "SmolLM2-135M-Instruct's tokenizer, one row per tokenizers version", "command": command,
                    "columns": COLUMNS, "rows": []}]}
    cells = [row["tokenizers"], str(row["vocabulary"]), str(row["tokens"]), f"{row['get_vocab_size_ms']:.3f}",
             f"{row['detokenize_ms']:.2f}", f"{row['with_logprobs_ms']:.2f}"]
    table = result["tables"][0]
    table["rows"] = [r for r in table["rows"] if r[0] != row["tokenizers"]] + [cells]
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".md").write_text(render_results.render(result))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the default model)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--result-file", metavar="MACHINE", default=None,
                        help="add the run to docs/benchmarks/results/<date>-MACHINE-detokenize.json")
    parser.add_argument("--json", default=None, help="write the measurement to this file too")
    args = parser.parse_args()
    from jaxllm.named_models import default_model_path

    row = measure(args.model or str(default_model_path()), args.tokens, args.repeats)
    host = common.host_info()
    host["load_avg_1m"] = round(host["load_avg_1m"], 1)
    print(common.format_table(COLUMNS, [[row["tokenizers"], row["vocabulary"], row["tokens"],
                                         f"{row['get_vocab_size_ms']:.3f}", f"{row['detokenize_ms']:.2f}",
                                         f"{row['with_logprobs_ms']:.2f}"]]))
    print(common.host_line(host))
    common.write_json(args.json, row)
    if args.result_file:
        command = "python scripts/bench_detokenize.py --result-file " + args.result_file
        print("added to", add_to_result_file(args.result_file, row, command, host))


if __name__ == "__main__":
    main()
