"""Where an engine step's time goes: a ``jax.profiler`` trace of real engine steps, reduced to a text table.

Two phases on one engine (weights and flags as ``bench_throughput.py``):

- ``decode``: ``--decode-rows`` requests with prompts sized so that, once every one has been prefilled, the
  decode-only steps traced run at about ``--decode-context`` tokens of context;
- ``mixed``: the throughput workload (``--num-requests``, ``--input-len``, ``--output-len``), traced from the first
  step that holds both decode rows and prefill chunks.

Each phase runs untraced until a step of the kind wanted, and ``--skip-steps`` more (so that the decode program does
not run for the first time under the profiler), traces ``--steps`` steps, then aborts its requests. The profiler's XSpace
(``*.xplane.pb``) is read back with ``jax.profiler.ProfileData`` (jaxlib's own reader: no TensorBoard plugin) and
reduced to, per phase:

- a table per step, from the step descriptors the engine dispatched (``BatchDescriptor``: rows, tokens, each row's
  KV length ``seq_lens``): the step's wall time (from its start to the next step's start: the period throughput
  sees), the device's busy and idle time within it, its largest idle gap, the host-device synchronizations and the
  transfers, and the bandwidth floor: ``bytes = parameter bytes once + sum(seq_lens) * KV bytes per token``
  (K and V, every layer), ``floor = bytes / HBM bandwidth``;
- the host's time per engine part (``schedule``, ``launch``, ``apply``, ``report``, annotated around the core's
  methods, and ``process_core_outputs``, the front end's output processing and metrics), per step; requests ask
  for final outputs only, as ``LLM.generate`` does;
- the top ``--top`` device ops or fusions by time per step (leaf events: a CPU thunk that holds others, such as the
  layer loop, is not counted over its body).

Device work is what the trace's device planes hold (a GPU's CUPTI stream lines; on the CPU, XLA's thunks, marked by
their ``hlo_op``). Host-device synchronizations are the host's reads of device arrays (``waits``: ``np.asarray`` of a
``jax.Array``, ``block_until_ready``, PjRt's waits) and, on a GPU, the CUDA driver's ``cu*Synchronize`` calls
(``cuSync``); transfers are JAX's ``device_put`` calls (``puts``, one per array) and a GPU's ``MemcpyH2D`` and
``MemcpyD2H`` copies with their bytes (none on a CPU, where the device's memory is the host's).
HBM bandwidth comes from ``_bench_common.HBM_BANDWIDTH_GBPS`` by device kind, or ``--bandwidth`` (GB/s); without
either the floor is "n/a".

Writes under ``--out``: ``profile.txt`` (the tables, also printed), ``profile.json`` (every number) and
``profile_trace.tar.gz`` (the raw traces: XSpace and Perfetto JSON of each phase, dropped in that order of need when
the archive would pass ``--max-trace-mib``).

    python scripts/profile_trace.py --model FOLDER_WITH_CONFIG_JSON --random-weights --out DIR [engine flags]
           [--decode-rows 256] [--decode-context 450] [--steps 4] [--skip-steps 2] [--top 15] [--bandwidth GB/s]
    python scripts/profile_trace.py --reduce DIR    # reduce the traces a run left in DIR again
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import io
import json
import math
import os
import re
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402
from _bench_common import device_bandwidth, floor_seconds, step_bytes  # noqa: E402

STEP_ANNOTATION = "engine_step"
# The core's methods annotated in the trace: the host's share of a step, per part; then the front end's (its
# output processing and metrics, on the same thread as the core's in an offline engine).
HOST_PARTS = ("_schedule", "_launch", "_apply", "_report")
FRONT_END_PARTS = ("_process_core_outputs",)
# Host events that wait for the device: JAX's reads of a device array to the host (``np.asarray``, the annotation
# jax.Array.__array__ carries), ``block_until_ready`` and PjRt's own waits; apart, the CUDA driver's
# synchronizations (GPU), since a read may hold one.
HOST_WAIT = re.compile(r"^np\.asarray\(jax\.Array\)$|block_until_ready|BlockHostUntilReady|PjRtBuffer::Await")
CUDA_SYNC = re.compile(r"^cu(Stream|Event|Ctx)Synchronize")
# Host-to-device transfer calls: JAX's device_put of host data (one per array).
HOST_PUT = re.compile(r"^DevicePutWithSharding$")
# Device planes: a GPU's (``/device:GPU:0``) or another accelerator's; the CPU's work is on ``/host:CPU``.
DEVICE_PLANE = re.compile(r"^/device:(?!CPU)")
# Lines of a device plane derived from others (their events repeat the streams'), skipped.
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework", "Source", "XLA TraceMe", "CUPTI overhead")
# A GPU memcpy's bytes, from its ``memcpy_details`` stat ("kind_src:... size:4096 ...").
MEMCPY_SIZE = re.compile(r"size:(\d+)")


@dataclasses.dataclass
class StepRecord:
    """One engine step as the engine dispatched it (from its ``BatchDescriptor``).

    Attributes:
      step: the engine step's index in the run; phase: "decode" or "mixed".
      program: the step program ``(T, S, W, decode_only)``; rows, tokens: real rows and tokens.
      kv_tokens: ``sum(seq_lens)``, every row's KV length after the step (context plus new tokens), which the
        attention reads; max_context: the longest row's; num_prefill_rows: rows with more than one new token.
    """

    step: int
    phase: str
    program: tuple
    rows: int
    tokens: int
    kv_tokens: int
    max_context: int
    num_prefill_rows: int

    @property
    def kind(self) -> str:
        """``decode`` (every row one new token), ``prefill`` (none is) or ``mixed``."""
        if self.num_prefill_rows == 0:
            return "decode"
        return "prefill" if self.num_prefill_rows == self.rows else "mixed"


def record_of(step: int, phase: str, batch: Any) -> StepRecord:
    """A :class:`StepRecord` of ``batch`` (a ``scheduler.batch.BatchDescriptor``)."""
    n = batch.num_seqs
    seq_lens = np.asarray(batch.seq_lens[:n], np.int64)
    new = np.diff(np.asarray(batch.query_start_loc[: n + 1], np.int64))
    return StepRecord(step=step, phase=phase, program=tuple(int(x) if not isinstance(x, bool) else x
                                                            for x in batch.program),
                      rows=n, tokens=int(batch.num_tokens), kv_tokens=int(seq_lens.sum()),
                      max_context=int(seq_lens.max(initial=0)), num_prefill_rows=int((new > 1).sum()))


# ------------------------------------------------------------------------------------------ reading the trace


@dataclasses.dataclass
class Event:
    """One trace event, times in ns from the trace's start."""

    start: float
    end: float
    name: str
    stats: dict


def _events(line: Any) -> list[Event]:
    out = []
    for e in line.events:
        start = float(e.start_ns)
        out.append(Event(start, start + float(e.duration_ns), e.name, dict(e.stats)))
    return out


def load_trace(path: str) -> dict[str, list[Event]]:
    """The events of an XSpace file (``*.xplane.pb``) that the reduction reads, by kind.

    Returns:
      ``{"device": device work, "host": every other host event, "steps": the ``engine_step`` annotations}``, each
      sorted by start. Device work is every event of the device planes (a GPU's stream lines) when the trace has
      one, else the host events carrying ``hlo_op`` (XLA's CPU thunks); a device event's ``stats`` gain ``_line``
      (its plane and line, to tell nesting apart).
    """
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    planes = list(data.planes)
    has_device = any(DEVICE_PLANE.match(plane.name) for plane in planes)
    device, host, steps = [], [], []
    for plane in planes:
        on_device = bool(DEVICE_PLANE.match(plane.name))
        for index, line in enumerate(plane.lines):
            if on_device and line.name.startswith(DERIVED_LINES):
                continue
            for event in _events(line):
                event.stats["_line"] = (plane.name, index)
                if on_device or (not has_device and "hlo_op" in event.stats):
                    # The CPU thunk executor marks each thunk's end with a zero-length event of its own.
                    if not event.name.startswith("end: "):
                        device.append(event)
                elif event.name == STEP_ANNOTATION:
                    steps.append(event)
                elif not on_device:
                    host.append(event)
    for events in (device, host, steps):
        events.sort(key=lambda e: e.start)
    return {"device": device, "host": host, "steps": steps}


def leaf_events(events: Sequence[Event]) -> list[Event]:
    """The events that hold no other event of their line (a CPU ``while`` thunk holds its body's thunks)."""
    by_line: dict[Any, list[Event]] = {}
    for e in events:
        by_line.setdefault(e.stats.get("_line"), []).append(e)
    leaves = []
    for line in by_line.values():
        line.sort(key=lambda e: (e.start, -e.end))
        for i, e in enumerate(line):
            nxt = line[i + 1] if i + 1 < len(line) else None
            if nxt is None or not (nxt.start >= e.start and nxt.end <= e.end and e.end > e.start):
                leaves.append(e)
    return leaves


def busy_intervals(events: Iterable[Event], lo: float, hi: float) -> list[tuple[float, float]]:
    """The union of ``events``' spans clipped to ``[lo, hi)``, as sorted disjoint intervals."""
    spans = sorted((max(e.start, lo), min(e.end, hi)) for e in events if e.end > lo and e.start < hi)
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def op_name(event: Event) -> str:
    """An op's name: its ``hlo_op`` (XLA's fusion or instruction), else the kernel's or transfer's own name."""
    op = event.stats.get("hlo_op")
    return str(op) if op else event.name


def transfer_kind(event: Event) -> Optional[str]:
    """``"H2D"``, ``"D2H"``, ``"D2D"`` or ``"P2P"`` for a device memcpy event (by its name, else by the memory kinds
    of its ``memcpy_details``), else None."""
    match = re.match(r"Memcpy(H2D|D2H|D2D|P2P)", event.name)
    if match:
        return match.group(1)
    kinds = re.search(r"kind_src:(\w+) kind_dst:(\w+)", str(event.stats.get("memcpy_details", "")))
    if kinds is None:
        return None
    src, dst = (("D" if k == "device" else "H") for k in kinds.groups())
    return f"{src}2{dst}" if src + dst != "HH" else None


def transfer_bytes(event: Event) -> int:
    """A memcpy event's bytes (its ``memcpy_details`` stat), 0 when not recorded."""
    match = MEMCPY_SIZE.search(str(event.stats.get("memcpy_details", "")))
    return int(match.group(1)) if match else 0


# ------------------------------------------------------------------------------------------ reduction


def reduce_phase(trace: dict[str, list[Event]], records: dict[int, StepRecord], *, weight_bytes: int,
                 kv_bytes_per_token: float, bandwidth_gbps: Optional[float], top: int = 15) -> dict[str, Any]:
    """Per-step and per-op figures of one traced phase.

    Args:
      trace: :func:`load_trace`'s events; the ``engine_step`` annotations carry ``step_num``.
      records: the engine's step descriptors by step index (steps without one are skipped, and so is the last
        annotation, which only ends the one before it).
      weight_bytes: parameter bytes, read once a step; kv_bytes_per_token: KV bytes of one token, K and V, every
        layer; bandwidth_gbps: HBM GB/s, None for no floor.

    Returns:
      ``{"steps": [per step: step, kind, rows, tokens, mean_context, bytes, floor_ms, wall_ms, wall_over_floor,
      device_busy_ms, device_idle_ms, max_gap_ms, gaps_over_100us, waits, cuda_syncs, puts, h2d, d2h, h2d_bytes,
      d2h_bytes, host_ms (per HOST_PARTS)], "ops": [top ops: name, ms_per_step, count_per_step, share of busy],
      "sync_names": {name: count per step}}``; times in ms.
    """
    marks = [e for e in trace["steps"] if int(e.stats.get("step_num", -1)) in records]
    all_marks = trace["steps"]
    device, host = trace["device"], trace["host"]
    leaves = leaf_events(device)
    steps, op_time, op_count, sync_names = [], {}, {}, {}
    for mark in marks:
        later = [m.start for m in all_marks if m.start > mark.start]
        if not later:
            continue  # the phase's last step only ends the one before it
        lo, hi = mark.start, later[0]
        rec = records[int(mark.stats["step_num"])]
        busy = busy_intervals(device, lo, hi)
        busy_ns = sum(b - a for a, b in busy)
        edges = [lo] + [x for span in busy for x in span] + [hi]
        gaps = [edges[i + 1] - edges[i] for i in range(0, len(edges), 2)]
        in_window = [e for e in host if lo <= e.start < hi]
        waits = [e for e in in_window if HOST_WAIT.search(e.name)]
        cuda_syncs = [e for e in in_window if CUDA_SYNC.search(e.name)]
        puts = sum(bool(HOST_PUT.search(e.name)) for e in in_window)
        for e in waits + cuda_syncs:
            sync_names[e.name] = sync_names.get(e.name, 0) + 1
        moves = {"H2D": [0, 0], "D2H": [0, 0]}
        for e in device:
            kind = transfer_kind(e)
            if kind in moves and lo <= e.start < hi:
                moves[kind][0] += 1
                moves[kind][1] += transfer_bytes(e)
        for e in leaves:
            if lo <= e.start < hi:
                name = op_name(e)
                op_time[name] = op_time.get(name, 0.0) + (e.end - e.start)
                op_count[name] = op_count.get(name, 0) + 1
        host_ms = {}
        for part in HOST_PARTS + FRONT_END_PARTS:
            spans = busy_intervals((e for e in in_window if e.name == part), lo, hi)
            host_ms[part.lstrip("_")] = sum(b - a for a, b in spans) / 1e6
        num_bytes = step_bytes(weight_bytes, rec.kv_tokens, kv_bytes_per_token)
        floor = floor_seconds(num_bytes, bandwidth_gbps)
        wall_ms = (hi - lo) / 1e6
        steps.append(dict(
            step=rec.step, kind=rec.kind, program=list(rec.program), rows=rec.rows, tokens=rec.tokens,
            kv_tokens=rec.kv_tokens, mean_context=rec.kv_tokens / max(rec.rows, 1), max_context=rec.max_context,
            bytes=num_bytes, floor_ms=None if floor is None else floor * 1e3, wall_ms=wall_ms,
            wall_over_floor=None if floor is None else wall_ms / (floor * 1e3),
            device_busy_ms=busy_ns / 1e6, device_idle_ms=(hi - lo - busy_ns) / 1e6, max_gap_ms=max(gaps) / 1e6,
            gaps_over_100us=sum(g > 1e5 for g in gaps), waits=len(waits), cuda_syncs=len(cuda_syncs), puts=puts,
            h2d=moves["H2D"][0], d2h=moves["D2H"][0], h2d_bytes=moves["H2D"][1], d2h_bytes=moves["D2H"][1],
            host_ms=host_ms,
        ))
    n = max(len(steps), 1)
    total_busy = sum(op_time.values()) or 1.0
    ops = [dict(name=name, ms_per_step=t / 1e6 / n, count_per_step=op_count[name] / n, share=t / total_busy)
           for name, t in sorted(op_time.items(), key=lambda kv: -kv[1])[:top]]
    return {"steps": steps, "ops": ops, "num_ops": len(op_time),
            "sync_names": {k: v / n for k, v in sorted(sync_names.items(), key=lambda kv: -kv[1])}}


def _ms(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 3)


def format_phase(name: str, result: dict[str, Any]) -> str:
    """One phase's tables: steps, host parts, top ops (the text ``profile.txt`` holds)."""
    steps = result["steps"]
    lines = [f"--- {name}: {len(steps)} steps"]
    header = ["step", "kind", "T,S", "rows", "tokens", "mean ctx", "GB", "floor ms", "wall ms", "wall/floor",
              "busy ms", "idle ms", "max gap", "gaps>100us", "waits", "cuSync", "puts", "H2D", "D2H"]
    rows = [[s["step"], s["kind"], f"{s['program'][0]},{s['program'][1]}", s["rows"], s["tokens"],
             round(s["mean_context"], 1), round(s["bytes"] / 1e9, 4), _ms(s["floor_ms"]), _ms(s["wall_ms"]),
             None if s["wall_over_floor"] is None else f"{s['wall_over_floor']:.2f}x", _ms(s["device_busy_ms"]),
             _ms(s["device_idle_ms"]), _ms(s["max_gap_ms"]), s["gaps_over_100us"], s["waits"], s["cuda_syncs"], s["puts"],
             f"{s['h2d']}/{s['h2d_bytes'] / 1e6:.2f}MB", f"{s['d2h']}/{s['d2h_bytes'] / 1e6:.2f}MB"] for s in steps]
    lines.append(common.format_table(header, rows))
    if steps:
        mean = {k: float(np.mean([s[k] for s in steps])) for k in ("wall_ms", "device_busy_ms", "device_idle_ms")}
        floors = [s["floor_ms"] for s in steps if s["floor_ms"] is not None]
        floor = float(np.mean(floors)) if floors else None
        lines.append(f"mean: wall {mean['wall_ms']:.3f} ms, device busy {mean['device_busy_ms']:.3f} ms "
                     f"({mean['device_busy_ms'] / mean['wall_ms']:.0%} of wall), idle {mean['device_idle_ms']:.3f} ms"
                     + ("; bandwidth floor n/a" if floor is None else
                        f"; floor {floor:.3f} ms: wall {mean['wall_ms'] / floor:.2f}x the floor, "
                        f"{floor / mean['wall_ms']:.0%} of the bandwidth limit"))
        parts = list(steps[0]["host_ms"])
        lines.append("host ms per step by engine part: " + ", ".join(
            f"{p} {np.mean([s['host_ms'][p] for s in steps]):.3f}" for p in parts))
    if result["sync_names"]:
        lines.append("synchronizations per step: " + ", ".join(f"{k} {v:.1f}" for k, v in result["sync_names"].items()))
    if not result["num_ops"]:
        lines.append("no device work in the trace: the profiler recorded no device plane (on a GPU: CUPTI did not "
                     "start) and no XLA thunk")
    lines.append(f"top {len(result['ops'])} of {result['num_ops']} device ops or fusions by time per step:")
    lines.append(common.format_table(
        ["op or fusion", "ms/step", "calls/step", "share of op time"],
        [[o["name"][:72], round(o["ms_per_step"], 4), round(o["count_per_step"], 1), f"{o['share']:.1%}"]
         for o in result["ops"]]))
    return "\n".join(lines)


def xplane_of(trace_dir: str) -> Optional[str]:
    """The newest ``*.xplane.pb`` under ``trace_dir`` (jax.profiler writes ``plugins/profile/<run>/``)."""
    found = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    return found[-1] if found else None


def reduce_run(out: Path, meta: dict[str, Any], top: int) -> tuple[str, dict[str, Any]]:
    """Reduce every phase's trace under ``out/trace/<phase>`` with ``meta`` (the run's ``profile.json`` fields)."""
    text = [header_line(meta)]
    results = {}
    for phase in meta["phases"]:
        path = xplane_of(str(out / "trace" / phase))
        if path is None:
            text.append(f"--- {phase}: no trace written (jax.profiler wrote no .xplane.pb)")
            continue
        records = {r["step"]: StepRecord(**{**r, "program": tuple(r["program"])}) for r in meta["records"]
                   if r["phase"] == phase}
        results[phase] = reduce_phase(load_trace(path), records, weight_bytes=meta["weight_bytes"],
                                      kv_bytes_per_token=meta["kv_bytes_per_token"],
                                      bandwidth_gbps=meta["bandwidth_gbps"], top=top)
        text.append(format_phase(phase, results[phase]))
    return "\n\n".join(text), results


def header_line(meta: dict[str, Any]) -> str:
    bw = meta["bandwidth_gbps"]
    source = meta.get("bandwidth_source", "")
    return (f"profile: {meta['device']} ({meta['backend']}), JAX {meta['jax']}, commit {meta.get('commit') or '?'}; "
            f"parameters {meta['weight_bytes'] / 1e9:.4f} GB, KV {meta['kv_bytes_per_token']:.0f} B/token; "
            + (f"bandwidth {bw:.0f} GB/s ({source})" if bw else "bandwidth n/a (no entry for this device; "
               "--bandwidth GB/s sets one)")
            + "\nfloor = (parameters + sum over rows of seq_lens x KV bytes/token) / bandwidth; wall = this step's "
              "start to the next's; busy/idle = device time within it")


# ------------------------------------------------------------------------------------------ running the engine


class StepRecorder:
    """While entered, wraps an ``EngineCore``'s ``runner.dispatch`` to keep each dispatched step's
    :class:`StepRecord` (``records``), and annotates the core's :data:`HOST_PARTS` (and the front end's
    :data:`FRONT_END_PARTS` when ``front_end`` is given: an ``LLMEngine``) in the trace; leaving restores them."""

    def __init__(self, core: Any, front_end: Any = None):
        self.core = core
        self.annotated = [(core, part) for part in HOST_PARTS]
        if front_end is not None:
            self.annotated += [(front_end, part) for part in FRONT_END_PARTS]
        self.records: list[StepRecord] = []
        self.step, self.phase = -1, ""

    def __enter__(self) -> "StepRecorder":
        import jax

        dispatch = self.core.runner.dispatch

        @functools.wraps(dispatch)
        def recorded(batch, *args, **kwargs):
            self.records.append(record_of(self.step, self.phase, batch))
            return dispatch(batch, *args, **kwargs)

        self.core.runner.dispatch = recorded
        for obj, part in self.annotated:
            setattr(obj, part, _annotated(jax.profiler.TraceAnnotation, part, getattr(obj, part)))
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.core.runner.dispatch
        for obj, part in self.annotated:
            delattr(obj, part)

    def last(self) -> Optional[StepRecord]:
        """The current step's record, None when it dispatched nothing."""
        return self.records[-1] if self.records and self.records[-1].step == self.step else None


def _annotated(annotation: Callable, name: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def run(*args, **kwargs):
        with annotation(name):
            return method(*args, **kwargs)

    return run


def run_phase(engine: Any, recorder: StepRecorder, phase: str, prompts: list[list[int]], max_tokens: list[int],
              ready: Callable[[StepRecord], bool], *, steps: int, skip: int, trace_dir: Path,
              python_tracer: bool, step_base: int) -> int:
    """Queue the phase's requests, step until a step for which ``ready`` holds and ``skip`` more, trace ``steps + 1``
    steps (the last one only ends the one before it), abort what is left; returns the next step index.

    Raises:
      RuntimeError: the requests ran out before the phase was traced.
    """
    import jax

    from jaxllm import RequestOutputKind, SamplingParams

    ids = [f"{phase}-{i}" for i in range(len(prompts))]
    for rid, prompt, n in zip(ids, prompts, max_tokens):
        # Final outputs only, as LLM.generate (the throughput stage) asks for them.
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                       output_kind=RequestOutputKind.FINAL_ONLY))
    step, started = step_base, None
    recorder.phase = phase

    def one_step() -> None:
        nonlocal step
        recorder.step = step
        with jax.profiler.StepTraceAnnotation(STEP_ANNOTATION, step_num=step):
            engine.step()
        step += 1

    while started is None or step - started < skip:
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"phase {phase}: the requests finished before a step was ready to trace")
        one_step()
        rec = recorder.last()
        if started is None and rec is not None and ready(rec):
            started = step
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python_tracer else 0
    jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True, profiler_options=options)
    try:
        for _ in range(steps + 1):
            one_step()
    finally:
        jax.profiler.stop_trace()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return step


def decode_prompts(rng: np.random.Generator, rows: int, context: int, max_num_batched_tokens: int,
                   vocab: int) -> tuple[list[list[int]], int]:
    """Prompts whose rows reach about ``context`` tokens by the time all ``rows`` are decoding (the first ones
    decode while the later ones prefill, about ``rows * context / max_num_batched_tokens`` steps), and the step
    count that takes."""
    prefill_steps = math.ceil(rows * context / max_num_batched_tokens)
    mean = max(context - prefill_steps // 2, 2)
    spread = max(mean // 20, 1)
    lens = rng.integers(max(mean - spread, 1), mean + spread + 1, size=rows)
    return [rng.integers(0, min(vocab, 10000), size=int(n)).tolist() for n in lens], prefill_steps


def profile_engine(engine: Any, out: Path, *, phases: Sequence[str], mixed: "common.Workload", decode_rows: int,
                   decode_context: int, steps: int, skip_steps: int, bandwidth_gbps: Optional[float] = None,
                   python_tracer: bool = False, seed: int = 0) -> dict[str, Any]:
    """Trace ``phases`` on ``engine`` (a one-replica ``LLMEngine`` with nothing queued) into ``out/trace/<phase>``.

    Args:
      mixed: the mixed phase's requests; decode_rows, decode_context: the decode phase's rows and their context;
      steps, skip_steps: steps traced, and steps of the wanted kind run first untraced, per phase;
      bandwidth_gbps: the floor's bandwidth, default by device kind (:func:`device_bandwidth`).

    Returns:
      the run's description: device, backend, JAX version, commit, phases, ``weight_bytes`` (parameters),
      ``kv_bytes_per_token`` (K and V of every layer), bandwidth and its source, every step's record.
    """
    import jax

    core = engine.core
    kv_bytes = sum(c.nbytes for c in core.runner.cache_engine.kv_cache)
    kv_per_token = kv_bytes / (core.num_blocks * core.scheduler.config.block_size)
    device = jax.devices()[0]
    source = "--bandwidth"
    if bandwidth_gbps is None:
        bandwidth_gbps, source = device_bandwidth(device.device_kind), "HBM_BANDWIDTH_GBPS by device kind"
    vocab = core.model_config.vocab_size
    rng = np.random.default_rng(seed)
    step = 0
    with StepRecorder(core, engine) as recorder:
        for phase in phases:
            if phase == "mixed":
                prompts, max_tokens = mixed.prompts, mixed.output_lens

                def ready(r: StepRecord) -> bool:
                    return r.kind == "mixed"
            else:
                prompts, prefill_steps = decode_prompts(rng, decode_rows, decode_context,
                                                        core.scheduler.config.max_num_batched_tokens, vocab)
                max_tokens = [prefill_steps + skip_steps + steps + 8] * len(prompts)

                def ready(r: StepRecord) -> bool:
                    return r.kind == "decode" and r.rows == decode_rows
            start = time.perf_counter()
            step = run_phase(engine, recorder, phase, prompts, max_tokens, ready, steps=steps, skip=skip_steps,
                             trace_dir=out / "trace" / phase, python_tracer=python_tracer, step_base=step)
            print(f"phase {phase}: {len(prompts)} requests, traced {steps} steps, "
                  f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return dict(device=device.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                commit=common.git_commit(), phases=list(phases), weight_bytes=int(core.param_bytes["total"]),
                kv_bytes_per_token=kv_per_token, bandwidth_gbps=bandwidth_gbps,
                bandwidth_source=source if bandwidth_gbps else None,
                records=[dataclasses.asdict(r) for r in recorder.records])


def run(args: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    """Build the engine of the flags, :func:`profile_engine` it; returns the run's description with the flags."""
    from jaxllm import LLMEngine

    engine = LLMEngine(str(model), **common.engine_kwargs(args, "continuous"))
    try:
        engine.wait_for_warmup()
        mixed = common.make_workload(args, common.vocab_size(model), token_seed=11)
        meta = profile_engine(engine, out, phases=args.phases, mixed=mixed, decode_rows=args.decode_rows,
                              decode_context=args.decode_context, steps=args.steps, skip_steps=args.skip_steps,
                              bandwidth_gbps=args.bandwidth, python_tracer=args.python_tracer, seed=args.seed)
    finally:
        engine.shutdown()
    return {**meta, "config": vars(args)}


def pack_traces(out: Path, limit_mib: float) -> Path:
    """``out/profile_trace.tar.gz`` of the phases' trace files, Perfetto JSON left out first, then XSpace, while the
    archive passes ``limit_mib``; every file left out is named in ``LEFT_OUT.txt`` inside it."""
    files = sorted(p for p in (out / "trace").rglob("*") if p.is_file())
    kept = list(files)
    target = out / "profile_trace.tar.gz"
    for drop in (None, "perfetto_trace.json.gz", ".trace.json.gz", ".xplane.pb"):
        if drop is not None:
            kept = [p for p in kept if not p.name.endswith(drop)]
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for p in kept:
                tar.add(p, arcname=str(p.relative_to(out)))
            left = sorted(set(files) - set(kept))
            if left:
                note = ("left out to stay under %.0f MiB:\n" % limit_mib
                        + "".join(f"{p.relative_to(out)} {p.stat().st_size} bytes\n" for p in left)).encode()
                info = tarfile.TarInfo("trace/LEFT_OUT.txt")
                info.size = len(note)
                tar.addfile(info, io.BytesIO(note))
        if buffer.tell() <= limit_mib * 2**20:
            break
    target.write_bytes(buffer.getvalue())
    return target


def main(argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser, num_requests=256, input_len=(100, 512), output_len=(100, 256), max_num_seqs=256,
                           max_model_len=1024)
    parser.add_argument("--out", default="profile_out", help="folder for profile.txt, profile.json and the traces")
    parser.add_argument("--phases", nargs="+", choices=["decode", "mixed"], default=["decode", "mixed"])
    parser.add_argument("--decode-rows", type=int, default=256, help="rows of the decode-only steps traced")
    parser.add_argument("--decode-context", type=int, default=450,
                        help="tokens of context the decode-only steps traced run at, about")
    parser.add_argument("--steps", type=int, default=4, help="steps traced per phase")
    parser.add_argument("--skip-steps", type=int, default=2,
                        help="steps run untraced after the first of the wanted kind (no program runs first under the profiler)")
    parser.add_argument("--top", type=int, default=15, help="device ops or fusions listed per phase")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="memory bandwidth in GB/s for the floor (default: by device kind, HBM_BANDWIDTH_GBPS; "
                             "none on a CPU)")
    parser.add_argument("--python-tracer", action="store_true",
                        help="also trace every Python call (slows the host part of each step several-fold)")
    parser.add_argument("--max-trace-mib", type=float, default=15.0,
                        help="size limit of profile_trace.tar.gz; the largest trace files are left out past it")
    parser.add_argument("--reduce", default=None, metavar="DIR",
                        help="only reduce the traces a run left in DIR (its profile.json and trace/) again")
    args = parser.parse_args(argv)
    common.validate_ranges(parser, args)
    if args.steps < 1 or args.skip_steps < 0 or args.decode_rows < 1 or args.decode_context < 2:
        parser.error("need --steps >= 1, --skip-steps >= 0, --decode-rows >= 1, --decode-context >= 2")
    if args.decode_rows > args.max_num_seqs and "decode" in args.phases:
        parser.error(f"--decode-rows {args.decode_rows} > --max-num-seqs {args.max_num_seqs}: never all decoding")
    if args.data_parallel_size > 1:
        parser.error("--data-parallel-size: the profile reads one in-process engine core; use 1")
    if args.reduce:
        out = Path(args.reduce)
        meta = json.loads((out / "profile.json").read_text())
    else:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with common.temporary_workdir() as workdir:
            model = common.resolve_model(args, Path(workdir))
            meta = run(args, model, out)
        (out / "profile.json").write_text(json.dumps(meta, indent=1, default=str))
    text, results = reduce_run(out, meta, args.top)
    (out / "profile.txt").write_text(text + "\n")
    meta["results"] = results
    (out / "profile.json").write_text(json.dumps(meta, indent=1, default=str))
    common.write_json(args.output_json, meta)
    if not args.reduce:
        archive = pack_traces(out, args.max_trace_mib)
        text += f"\n\nraw traces: {archive} ({archive.stat().st_size / 2**20:.2f} MiB; XSpace and Perfetto JSON)"
    print(text)
    print(common.host_line(common.host_info()))
    return text


if __name__ == "__main__":
    main()
