"""Engine metrics: Prometheus series named as vLLM's (``jaxllm:`` prefix, or vLLM's names with
``metrics_namespace="vllm"``), a periodic log line, the ``generate`` progress bar. Series: docs/design/metrics.md.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import numpy as np
import prometheus_client as prom
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString
from tqdm import tqdm

from jaxllm.config import METRICS_NAMESPACES
from jaxllm.core.messages import CoreStats
from jaxllm.logger import init_logger
from jaxllm.outputs import RequestOutput

if TYPE_CHECKING:
    from jaxllm.frontend.output_processor import RequestState

logger = init_logger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's buckets of its per-request histograms: whole-request phases, and the mean time per output token.
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_STEP_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)
# Whole engine steps: the board's step-delay threshold is 50 ms on a GPU; CPU steps run to seconds.
_ENGINE_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FINISHED_REASONS = ("stop", "length", "abort")
_TIERS = ("device", "host")
_TRANSFER_TYPES = ("GPU_to_CPU", "CPU_to_GPU")
# CoreStats fields of the host tier's counters: hits by tier ("device" is the rest), bytes and seconds each way.
_OFFLOAD_FIELDS = ("prefix_cache_hits_host", "kv_offload_bytes_to_host", "kv_offload_bytes_to_device",
                   "kv_offload_seconds_to_host", "kv_offload_seconds_to_device")
# Cumulative CoreStats fields published as counters of the same meaning, (field, series, help): the output-length
# predictor's record and the blocks the scheduler's pool tier took.
_COUNTED = (
    ("num_predicted_finished", "request_output_length_predictions",
     "Finished requests whose output length the scheduler predicted at arrival."),
    ("predicted_output_tokens", "request_predicted_output_tokens",
     "Output tokens of those requests, as predicted at arrival."),
    ("actual_output_tokens", "request_actual_output_tokens", "Output tokens of those requests, as generated."),
    ("prediction_abs_error_tokens", "request_output_length_prediction_abs_error_tokens",
     "Sum over those requests of |predicted - generated| output tokens."),
    ("num_blocks_pooled", "kv_blocks_pooled",
     "KV blocks moved into the scaled one-byte pool instead of a preemption."),
)
# The series vLLM 0.32 publishes under these names with the same meaning (its metrics documentation).
VLLM_SERIES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "iteration_tokens_total", "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
    "request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_time_per_output_token_seconds",
})


class BatchHistogram:
    """A Prometheus histogram observed a step's values at once: one numpy bucket search for all of them, where
    ``prometheus_client.Histogram.observe`` takes a lock and scans the buckets in Python per value. Exposed as
    that class exposes one: ``_bucket`` per ``le`` (cumulative), ``_count``, ``_sum`` (added value by value, so
    it rounds as that class's does) and ``_created`` (unless prometheus_client's created series are disabled).
    Its counts live in this process: a multiprocess collector does not see them.

    Args:
      name: the series name. documentation: its help text. buckets: upper bounds, ascending (+Inf is added).
      registry: where it registers (``ValueError`` there if the name is taken).
      labels: label names and their one bound set of values.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: prom.CollectorRegistry,
                 labels: Sequence[tuple[str, str]] = ()) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = np.array([*buckets, np.inf], np.float64)
        self._label_names, self._label_values = [k for k, _ in labels], [v for _, v in labels]
        self._counts = np.zeros(len(self._bounds), np.int64)
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: Sequence[float]) -> None:
        """Count ``values`` (in the buckets' unit); a value equal to a bound falls in its bucket, NaN in none (it
        still joins the sum), as ``Histogram.observe`` does. Raises ValueError/TypeError for non-numbers."""
        if not len(values):
            return
        values = np.asarray(values, np.float64)
        index = np.searchsorted(self._bounds, values, side="left")
        # NaN sorts past +Inf.
        counts = np.bincount(index[index < len(self._bounds)], minlength=len(self._bounds))
        with self._lock:
            self._counts += counts
            total = self._sum
            for value in values.tolist():
                total += value
            self._sum = total

    def describe(self):
        """The series' name and type, without samples (what a ``CollectorRegistry`` indexes it by)."""
        yield HistogramMetricFamily(self._name, self._documentation, labels=self._label_names)

    def collect(self):
        """The series with its samples now, as ``Histogram.collect`` gives them."""
        with self._lock:
            cumulative, total = np.cumsum(self._counts).tolist(), self._sum
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._label_names)
        bounds = [floatToGoString(b) for b in self._bounds]
        family.add_metric(self._label_values, list(zip(bounds, cumulative)), total)
        # prometheus_client's own switch (PROMETHEUS_DISABLE_CREATED_SERIES, disable_created_metrics()).
        if prom.metrics._use_created:
            family.add_sample(f"{self._name}_created", dict(zip(self._label_names, self._label_values)),
                              self._created)
        yield family


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets of per-request token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class EngineMetrics:
    """The metrics of one front end (its own ``CollectorRegistry``), updated each step from the touched requests'
    states and ``CoreStats``.

    Args:
      log_stats: log a summary line every ``log_interval`` seconds. metrics_port: serve ``/metrics`` there.
      clock: monotonic seconds, the clock of request arrival times.
      max_num_seqs, max_num_batched_tokens: each core's limits (``batch_utilization``'s denominators).
      max_model_len: tokens per request at most (the top bucket of the per-request token histograms).
      namespace: "jaxllm" or "vllm". model_name: the ``model_name`` label under "vllm".

    Attributes:
      registry: the ``CollectorRegistry``. core_stats: each core's latest ``CoreStats``, by core index.
    """

    def __init__(self, *, log_stats: bool = False, log_interval: float = 5.0, metrics_port: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic, max_num_seqs: int = 1, max_num_batched_tokens: int = 1,
                 max_model_len: int = 8192, namespace: str = "jaxllm", model_name: str = ""):
        if namespace not in METRICS_NAMESPACES:
            raise ValueError(f"metrics_namespace={namespace!r} must be one of {METRICS_NAMESPACES}")
        self.namespace, self.model_name = namespace, model_name
        self.registry = prom.CollectorRegistry()
        self._clock = clock
        self._max_num_seqs, self._max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self._max_model_len = max_model_len
        self._define_series()
        self._last_token_time: dict[str, float] = {}
        # Each core's latest stats; gauges show their sum, counters follow the sums by deltas.
        self.core_stats: dict[int, CoreStats] = {}
        self._seen_queries = self._seen_hits = self._seen_preemptions = self._seen_compilations = 0
        self._seen_offload = [0] * (len(_OFFLOAD_FIELDS) + 1)
        self._seen_counted = [0] * len(_COUNTED)
        self._seen_spec: list[int] = [0, 0, 0]
        self._seen_spec_per_position: list[int] = []
        self.log_stats = log_stats
        self.log_interval = log_interval
        self._log_at = clock()
        self._log_tokens = [0, 0]
        if log_stats:
            logger.setLevel(logging.INFO)
        self._http_server = None
        if metrics_port is not None:
            self._http_server, _ = prom.start_http_server(metrics_port, registry=self.registry)
        self.begin_run()

    def _define_series(self) -> None:
        r = self.registry
        # Under vLLM's namespace every series carries vLLM's model_name label, bound here once.
        fixed = (self.model_name,) if self.namespace == "vllm" else ()
        labels = ("model_name",) if fixed else ()

        def bound(metric):
            return metric.labels(*fixed) if fixed else metric

        def gauge(name: str, doc: str) -> prom.Gauge:
            return bound(prom.Gauge(self.series_name(name), doc, labels, registry=r))

        def counter(name: str, doc: str) -> prom.Counter:
            return bound(prom.Counter(self.series_name(name), doc, labels, registry=r))

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> prom.Histogram:
            return bound(prom.Histogram(self.series_name(name), doc, labels, buckets=buckets, registry=r))

        def labelled(kind, name: str, doc: str, label: str, values: Sequence[str] = ()) -> "_Labelled":
            metric = _Labelled(kind(self.series_name(name), doc, (*labels, label), registry=r), fixed)
            for value in values:
                metric.labels(value)  # shown as 0 before the first update
            return metric

        def labelled_gauge(name: str, doc: str, label: str, values: Sequence[str]) -> "_Labelled":
            return labelled(prom.Gauge, name, doc, label, values)

        self.num_requests_running = gauge("num_requests_running", "Requests holding a batch seat.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use, in [0, 1].")
        self.kv_cache_fragmentation = gauge(
            "kv_cache_fragmentation_ratio", "Allocated KV slots holding no computed token / allocated slots.")
        self.num_free_kv_blocks = gauge("num_free_kv_blocks", "Device KV blocks in the free queue.")
        self.num_kv_blocks = gauge("num_kv_blocks", "Device KV blocks in all, the null block included.")
        self.effective_max_num_seqs = gauge(
            "effective_max_num_seqs", "Batch seats in force (below max_num_seqs while graceful degradation backs off).")
        self.effective_max_num_batched_tokens = gauge(
            "effective_max_num_batched_tokens",
            "Token budget per step in force (below max_num_batched_tokens while graceful degradation backs off).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prefix_cache_hits_by_tier = labelled(
            prom.Counter, "prefix_cache_hits_by_tier", "Prompt tokens served from the prefix cache, by tier.", "tier",
            _TIERS)
        self.kv_offload_bytes = labelled(prom.Counter, "kv_offload_total_bytes",
                                         "Bytes the prefix cache's host tier copied, by direction.", "transfer_type",
                                         _TRANSFER_TYPES)
        self.kv_offload_time = labelled(prom.Counter, "kv_offload_total_time",
                                        "Seconds the prefix cache's host tier copies took, by direction.",
                                        "transfer_type", _TRANSFER_TYPES)
        self.kv_offload_usage = gauge("kv_offload_usage_perc",
                                      "Fraction of the host tier's blocks holding a block, in [0, 1].")
        self.counted = [counter(name, doc) for _, name, doc in _COUNTED]
        self.kv_pool_usage = gauge("kv_pool_usage_perc",
                                   "Fraction of the scaled KV pool's blocks held, in [0, 1].")
        self.num_preemptions = counter("num_preemptions", "Preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.compilations = counter("compilations", "Programs the engine compiled (warm-up included).")
        self.request_refused = counter(
            "request_refused", "New requests refused because max_waiting_requests sequences were waiting.")
        self.request_success = labelled(prom.Counter, "request_success", "Finished requests by finish reason.",
                                        "finished_reason", FINISHED_REASONS)
        self.batch_utilization = labelled_gauge(
            "batch_utilization", "Scheduled tokens / max_num_batched_tokens (tokens), running / max_num_seqs (seqs).",
            "resource", ("tokens", "seqs"))
        self.scheduler_queue_depth = labelled_gauge(
            "scheduler_queue_depth", "Requests in the schedulers' waiting queues: never run (new) or preempted.",
            "kind", ("new", "preempted"))
        self.batch_prompt_len_cv = gauge(
            "batch_prompt_len_cv", "Coefficient of variation (std / mean) of the running requests' prompt lengths.")
        self.step_duration = histogram(
            "step_duration_seconds", "Wall time of a whole engine step (host and device), seconds.",
            _ENGINE_STEP_BUCKETS)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token, seconds.", _LATENCY_BUCKETS)
        self.inter_token_latency = BatchHistogram(  # a value per decoding row a step, observed in one batch
            self.series_name("inter_token_latency_seconds"), "Time between a request's consecutive tokens, seconds.",
            _LATENCY_BUCKETS, r, labels=tuple(zip(labels, fixed)))
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish, seconds.", _LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling, seconds.", _LATENCY_BUCKETS)
        self._define_request_series(histogram)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.", _TOKEN_BUCKETS)
        self.scheduler_step = histogram(
            "scheduler_step_seconds", "Host time of one Scheduler.schedule(), seconds.", _STEP_BUCKETS)
        self.spec_decode = [
            counter("spec_decode_num_drafts", "Rows that verified draft tokens (speculative decoding)."),
            counter("spec_decode_num_draft_tokens", "Draft tokens verified."),
            counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
        ]
        self.spec_decode_per_position = labelled(
            prom.Counter, "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in their row.",
            "position")
        self.num_requests_waiting_for_grammar = gauge(
            "num_requests_waiting_for_grammar", "Waiting requests whose structured-output grammar is compiling.")
        self.grammar_bitmask = histogram(
            "grammar_bitmask_seconds", "Host time building a step's structured-output token bitmask, seconds.",
            _STEP_BUCKETS)

    def _define_request_series(self, histogram: Callable[..., prom.Histogram]) -> None:
        """vLLM's histograms of finished requests: their token counts and the phases of their time."""
        tokens = one_two_five_buckets(self._max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                               tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens each finished request generated (all n completions).", tokens)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Tokens of each finished request's longest completion.", tokens)
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduling to first token of each finished request, seconds.",
            _REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token of each finished request, seconds.",
            _REQUEST_LATENCY_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Each finished request's decode time / (tokens of its longest completion - 1), seconds (0 for one token).",
            _TPOT_BUCKETS)

    def series_name(self, name: str) -> str:
        """The exposed name of series ``name`` (e.g. "num_requests_running") in this namespace."""
        return f"{self.namespace if name in VLLM_SERIES else 'jaxllm'}:{name}"

    def begin_run(self) -> None:
        """Restart the per-run aggregates of :meth:`run_summary` (the Prometheus series keep counting)."""
        self._run_steps = 0
        self._run_usage_sum = 0.0
        self._run_peak_usage = 0.0
        self._run_live_slots = 0
        self._run_allocated_slots = 0
        self._run_max_running = 0
        self._run_base_preemptions = self._total("num_preemptions")
        self._run_base_compilations = self._total("compilations")
        self._run_base_spec = self._spec_totals()

    def _spec_totals(self) -> tuple[list[int], list[int]]:
        """Speculative decoding counters summed over the cores: (drafts, draft tokens, accepted), and per position."""
        totals = [int(self._total(f)) for f in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")]
        per_position: list[int] = []
        for stats in self.core_stats.values():
            for i, n in enumerate(stats.spec_accepted_per_position):
                per_position += [0] * (i + 1 - len(per_position))
                per_position[i] += n
        return totals, per_position

    def _total(self, field: str) -> float:
        return sum(getattr(s, field) for s in self.core_stats.values())

    def on_step(self, stats: CoreStats, requests: Sequence["RequestState"], core_index: int = 0) -> None:
        """Record one core's step (``stats``: its ``CoreStats``; ``requests``: the front-end states of the requests
        the step touched, after it: their new tokens, finishes and times, whatever outputs their kind asks for)."""
        now = self._clock()
        self.core_stats[core_index] = stats
        if stats.schedule_seconds is not None:
            self.scheduler_step.observe(stats.schedule_seconds)
            if stats.num_scheduled_tokens:
                self.iteration_tokens.observe(stats.num_scheduled_tokens)
        if stats.step_seconds is not None:
            self.step_duration.observe(stats.step_seconds)
        if stats.grammar_bitmask_seconds is not None:
            self.grammar_bitmask.observe(stats.grammar_bitmask_seconds)
        prompt_tokens = generation_tokens = 0
        inter_token = []
        for state in requests:
            new_tokens = sum(len(seq.delta_token_ids) for seq in state.seqs)
            if new_tokens:
                rid = state.request_id
                last = self._last_token_time.get(rid)
                if last is None:
                    prompt_tokens += len(state.prompt_token_ids)
                    self.time_to_first_token.observe(state.first_token_time - state.arrival_time)
                else:
                    inter_token.append(now - last)
                self._last_token_time[rid] = now
                generation_tokens += new_tokens
            if state.finished_time is not None:
                self._on_finished(state)
        self.inter_token_latency.observe_many(inter_token)
        # One increment a step: per request, each counter would take its lock once per decoding row.
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
            self._log_tokens[0] += prompt_tokens
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)
            self._log_tokens[1] += generation_tokens
        self._update_core_series(stepped=stats.schedule_seconds is not None)
        if self.log_stats and now - self._log_at >= self.log_interval:
            self._log(now)

    def _on_finished(self, state: "RequestState") -> None:
        """A finished request's count by finish reason and its histograms (vLLM's ``FinishedRequestStats``)."""
        self._last_token_time.pop(state.request_id, None)
        self.request_success.labels(state.seqs[0].finish_reason).inc()
        self.e2e_request_latency.observe(state.finished_time - state.arrival_time)
        if state.first_scheduled_time is not None:
            self.request_queue_time.observe(state.first_scheduled_time - state.arrival_time)
        lengths = [len(seq.token_ids) for seq in state.seqs]
        self.request_prompt_tokens.observe(len(state.prompt_token_ids))
        self.request_generation_tokens.observe(sum(lengths))
        self.request_max_num_generation_tokens.observe(max(lengths))
        first_token = state.first_token_time
        if first_token is None:
            return
        if state.first_scheduled_time is not None:
            self.request_prefill_time.observe(first_token - state.first_scheduled_time)
        decode = state.finished_time - first_token
        self.request_decode_time.observe(decode)
        self.request_time_per_output_token.observe(decode / (max(lengths) - 1) if max(lengths) > 1 else 0.0)

    def _update_core_series(self, stepped: bool) -> None:
        total = self._total
        running = total("num_running")
        usage = self._kv_cache_usage()
        live, allocated = total("kv_live_slots"), total("kv_allocated_slots")
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(total("num_waiting"))
        self.num_requests_waiting_for_grammar.set(total("num_waiting_for_grammar"))
        self.kv_cache_usage.set(usage)
        self.kv_cache_fragmentation.set(1.0 - live / allocated if allocated else 0.0)
        self.num_free_kv_blocks.set(total("num_free_blocks"))
        self.num_kv_blocks.set(total("num_blocks"))
        self.effective_max_num_seqs.set(total("max_num_seqs"))
        self.effective_max_num_batched_tokens.set(total("max_num_batched_tokens"))
        cores = len(self.core_stats)
        scheduled = sum(s.num_scheduled_tokens or 0 for s in self.core_stats.values())
        self.batch_utilization.labels("tokens").set(scheduled / (cores * self._max_num_batched_tokens))
        self.batch_utilization.labels("seqs").set(running / (cores * self._max_num_seqs))
        preempted = total("num_preempted_waiting")
        self.scheduler_queue_depth.labels("preempted").set(preempted)
        self.scheduler_queue_depth.labels("new").set(total("num_waiting") - preempted)
        # Each core's CV weighted by its running requests.
        self.batch_prompt_len_cv.set(
            sum(s.prompt_len_cv * s.num_running for s in self.core_stats.values()) / running if running else 0.0)
        queries, hits = total("prefix_cache_queries"), total("prefix_cache_hits")
        preemptions, compilations = total("num_preemptions"), total("compilations")
        self.prefix_cache_queries.inc(queries - self._seen_queries)
        self.prefix_cache_hits.inc(hits - self._seen_hits)
        self.num_preemptions.inc(preemptions - self._seen_preemptions)
        self.compilations.inc(compilations - self._seen_compilations)
        self._seen_queries, self._seen_hits = queries, hits
        self._update_offload_series(hits)
        counted = [total(field) for field, _, _ in _COUNTED]
        for metric, value, seen in zip(self.counted, counted, self._seen_counted):
            metric.inc(value - seen)
        self._seen_counted = counted
        pool = total("num_pool_blocks")
        self.kv_pool_usage.set(total("num_pool_in_use") / pool if pool else 0.0)
        self._seen_preemptions, self._seen_compilations = preemptions, compilations
        spec, per_position = self._spec_totals()
        for series, now, seen in zip(self.spec_decode, spec, self._seen_spec):
            series.inc(now - seen)
        for i, n in enumerate(per_position):
            seen = self._seen_spec_per_position[i] if i < len(self._seen_spec_per_position) else 0
            self.spec_decode_per_position.labels(str(i)).inc(n - seen)
        self._seen_spec, self._seen_spec_per_position = spec, per_position
        if stepped:
            self._run_steps += 1
            self._run_usage_sum += usage
            self._run_peak_usage = max(self._run_peak_usage, usage)
            self._run_live_slots += live
            self._run_allocated_slots += allocated
            self._run_max_running = max(self._run_max_running, running)

    def _update_offload_series(self, hits: float) -> None:
        """The host tier's series from the cores' totals (``hits``: all prefix-cache hits)."""
        now = [self._total(f) for f in _OFFLOAD_FIELDS]
        now = [hits - now[0]] + now
        series = (self.prefix_cache_hits_by_tier.labels("device"), self.prefix_cache_hits_by_tier.labels("host"),
                  self.kv_offload_bytes.labels("GPU_to_CPU"), self.kv_offload_bytes.labels("CPU_to_GPU"),
                  self.kv_offload_time.labels("GPU_to_CPU"), self.kv_offload_time.labels("CPU_to_GPU"))
        for metric, value, seen in zip(series, now, self._seen_offload):
            metric.inc(value - seen)
        self._seen_offload = now
        slots = self._total("num_offload_blocks")
        self.kv_offload_usage.set(self._total("num_offload_cached_blocks") / slots if slots else 0.0)

    def _kv_cache_usage(self) -> float:
        """The cores' ``kv_cache_usage`` weighted by their usable blocks."""
        usable = {i: s.num_blocks - 1 for i, s in self.core_stats.items()}
        total = sum(usable.values())
        return sum(s.kv_cache_usage * usable[i] for i, s in self.core_stats.items()) / total if total else 0.0

    def close(self) -> None:
        """Stop serving ``/metrics`` (if ``metrics_port`` was given), freeing the port."""
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None

    def forget(self, request_id: str) -> None:
        """Count an aborted request (``request_success{finished_reason="abort"}``) and drop its state."""
        self._last_token_time.pop(request_id, None)
        self.request_success.labels("abort").inc()

    def snapshot(self) -> list["Metric"]:
        """Every series now as vLLM's ``get_metrics`` reads them (``vllm.v1.metrics.reader``): a ``Gauge``, a
        ``Counter`` per label set, a ``Histogram`` per label set (cumulative bucket counts by upper bound, "+Inf"
        included, with count and sum), and the per-position accepted-draft counter as a ``Vector``."""
        out: list[Metric] = []
        for family in self.registry.collect():
            name = family.name

            def samples(suffix: str = ""):
                return [s for s in family.samples if s.name == name + suffix]

            if family.type == "gauge":
                out += [Gauge(name, dict(s.labels), s.value) for s in samples()]
            elif family.type == "counter" and any("position" in s.labels for s in samples("_total")):
                by_labels: dict[tuple, dict[int, int]] = {}
                for s in samples("_total"):
                    rest = {k: v for k, v in s.labels.items() if k != "position"}
                    by_labels.setdefault(tuple(sorted(rest.items())), {})[int(s.labels["position"])] = int(s.value)
                out += [Vector(name, dict(key), [counts.get(i, 0) for i in range(max(counts) + 1)])
                        for key, counts in by_labels.items()]
            elif family.type == "counter":
                out += [Counter(name, dict(s.labels), int(s.value)) for s in samples("_total")]
            elif family.type == "histogram":
                groups: dict[tuple, dict[str, Any]] = {}
                for s in samples("_bucket"):
                    rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                    groups.setdefault(rest, {})[s.labels["le"]] = int(s.value)
                totals = {tuple(sorted(s.labels.items())): s.value for s in samples("_count")}
                sums = {tuple(sorted(s.labels.items())): s.value for s in samples("_sum")}
                out += [Histogram(name, dict(key), int(totals.get(key, 0)), float(sums.get(key, 0.0)), buckets)
                        for key, buckets in groups.items()]
        return out

    def quantile(self, name: str, q: float) -> float:
        """The ``q`` quantile of histogram ``name`` as PromQL's ``histogram_quantile``; NaN before any observation.
        Raises ValueError: ``q`` outside [0, 1], or no histogram of that name."""
        if not 0 <= q <= 1:
            raise ValueError(f"q={q} must be in [0, 1]")
        bounds = []
        for metric in self.registry.collect():
            if metric.name == name and metric.type == "histogram":
                bounds = [(float(s.labels["le"]), s.value) for s in metric.samples if s.name == name + "_bucket"]
        if not bounds:
            raise ValueError(f"no histogram named {name!r} in this registry")
        count = bounds[-1][1]
        if count == 0:
            return float("nan")
        rank = q * count
        lower, below = 0.0, 0.0
        for upper, cumulative in bounds:
            if cumulative >= rank:
                if upper == float("inf"):
                    return lower
                return lower + (upper - lower) * (rank - below) / (cumulative - below)
            lower, below = upper, cumulative
        return lower

    def run_summary(self) -> dict[str, float]:
        """Aggregates since :meth:`begin_run`, for benchmarks: steps, KV usage, ``max_num_running``, preemptions,
        compilations and speculative acceptance."""
        steps = max(self._run_steps, 1)
        (drafts, draft_tokens, accepted), per_position = self._spec_totals()
        (base_drafts, base_tokens, base_accepted), base_per_position = self._run_base_spec
        drafts, draft_tokens, accepted = drafts - base_drafts, draft_tokens - base_tokens, accepted - base_accepted
        per_position = [n - (base_per_position[i] if i < len(base_per_position) else 0)
                        for i, n in enumerate(per_position)]
        return dict(
            steps=self._run_steps,
            peak_kv_cache_usage=self._run_peak_usage,
            mean_kv_cache_usage=self._run_usage_sum / steps,
            kv_live_slot_fraction=(self._run_live_slots / self._run_allocated_slots
                                   if self._run_allocated_slots else 1.0),
            max_num_running=self._run_max_running,
            num_preemptions=self._total("num_preemptions") - self._run_base_preemptions,
            compilations=self._total("compilations") - self._run_base_compilations,
            spec_num_draft_tokens=draft_tokens,
            spec_num_accepted_tokens=accepted,
            spec_acceptance_rate=accepted / draft_tokens if draft_tokens else None,
            spec_mean_accepted_length=1 + accepted / drafts if drafts else None,
            spec_acceptance_rate_per_position=[n / drafts for n in per_position] if drafts else None,
        )

    def log_now(self) -> None:
        """Log the summary line (throughputs since the last one, queue, KV usage, prefix hits) now (vLLM's
        ``do_log_stats``)."""
        self._log(self._clock())

    def _log(self, now: float) -> None:
        elapsed = max(now - self._log_at, 1e-9)
        total = self._total
        queries = total("prefix_cache_queries")
        hit_rate = total("prefix_cache_hits") / queries if queries else 0.0
        logger.info(
            "prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s, running: %d reqs, "
            "waiting: %d reqs, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%, preemptions: %d",
            self._log_tokens[0] / elapsed, self._log_tokens[1] / elapsed, total("num_running"),
            total("num_waiting"), 100 * self._kv_cache_usage(), 100 * hit_rate, total("num_preemptions"),
        )
        (drafts, draft_tokens, accepted), _ = self._spec_totals()
        if draft_tokens:
            logger.info("speculative decoding: %d draft tokens, %.1f%% accepted, mean accepted length %.2f",
                        draft_tokens, 100 * accepted / draft_tokens, 1 + accepted / drafts)
        self._log_at = now
        self._log_tokens = [0, 0]


@dataclasses.dataclass
class Metric:
    """One series of :meth:`EngineMetrics.snapshot` (vLLM's ``vllm.v1.metrics.reader.Metric``): its name and labels."""

    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    """A counter's value (vLLM's ``Counter``)."""

    value: int


@dataclasses.dataclass
class Gauge(Metric):
    """A gauge's value (vLLM's ``Gauge``)."""

    value: float


@dataclasses.dataclass
class Histogram(Metric):
    """Observations: ``count``, ``sum``, and ``buckets`` the cumulative count at or below each upper bound (the
    Prometheus ``le`` label, "+Inf" the whole count) (vLLM's ``Histogram``)."""

    count: int
    sum: float
    buckets: dict[str, int]


@dataclasses.dataclass
class Vector(Metric):
    """A counter per position, as a list (vLLM's ``Vector``, for the accepted draft tokens per position)."""

    values: list[int]


class _Labelled:
    """A labelled series whose leading labels (``model_name`` under "vllm") are fixed: ``labels`` takes the rest."""

    def __init__(self, metric, fixed: tuple[str, ...]) -> None:
        self._metric, self._fixed = metric, fixed

    def labels(self, *values: str):
        """The child series of these values of the labels after the fixed ones."""
        return self._metric.labels(*self._fixed, *values)


class GenerateProgress:
    """The ``LLM.generate`` progress bar over ``total`` requests (no-op unless ``enabled``; a callable ``enabled``
    makes the bar, as vLLM's ``use_tqdm``): finished, tokens/s."""

    def __init__(self, total: int, enabled: Union[bool, Callable[..., Any]] = True):
        if callable(enabled):
            self._bar = enabled(total=total, desc="Processed prompts", dynamic_ncols=True)
        else:
            self._bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True,
                             disable=not enabled)
        self._start = time.perf_counter()
        self._tokens = 0

    def update(self, outputs: Sequence[RequestOutput]) -> None:
        """Count the finished requests among ``outputs`` and their output tokens (every ``n`` completion)."""
        if getattr(self._bar, "disable", False):
            return
        self._tokens += sum(len(c.token_ids) for out in outputs if out.finished for c in out.outputs)
        rate = self._tokens / max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        self._bar.update(sum(1 for out in outputs if out.finished))

    def __enter__(self) -> "GenerateProgress":
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()
