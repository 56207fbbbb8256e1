#!/usr/bin/env bash
# GPU check: one script, about 7 minutes on one H100 or H200, from a copy of the repository alone.
#
#   bash scripts/gpu_check.sh                  # on the GPU machine, from the repository root or anywhere
#   bash scripts/gpu_check.sh --dry-run        # on a CPU: every stage with shrunken sizes, kernels interpreted
#   bash scripts/gpu_check.sh --only profile,throughput   # a rerun of some stages (kernel-tests,
#                                              # kernel-bench, parity, throughput, anchor, profile); setup always runs
#   bash scripts/gpu_check.sh --help           # this text
#
# Stages, each under `timeout` and all within a 470 s budget (the start prints each stage's estimate, so that
# a run and a rerun fit one 15-minute lease); a failed, skipped or timed-out stage never stops the next one,
# and a summary table ends the log:
#   setup        Python and JAX versions, devices; `pip install -e .[cuda12]` only when JAX sees no GPU
#   kernel tests tests/test_kernels_pallas.py compiled through Triton (JAXLLM_PALLAS_INTERPRET=0), and on Hopper
#                tests/test_kernels_mosaic.py's kernel-against-reference cases compiled through Mosaic GPU
#   kernel bench scripts/bench_kernels.py: the Triton and Mosaic GPU kernels vs
#                jax.experimental.pallas.ops.gpu.paged_attention vs reference
#   parity       tests/test_pallas_engine.py: pallas vs reference greedy tokens, float32 and bfloat16
#   throughput   scripts/bench_throughput.py, 256 requests on a Qwen3-0.6B-shaped random-weights folder, with
#                jaxllm's fraction of the bandwidth limit ((steps x parameter bytes + the workload's KV reads) /
#                HBM bandwidth, _bench_common.run_bandwidth)
#   anchor       scripts/bench_hf_anchor.py: transformers' continuous batching (paged|sdpa) on the same shape,
#                random weights, workload and bf16 with torch on the GPU, its tok/s, ms per step and fraction of
#                the bandwidth limit in one table beside jaxllm's, against the 50-68% vLLM-class engines reach;
#                skipped when torch sees no CUDA
#   profile      scripts/profile_trace.py on the same model and engine flags: a jax.profiler trace of a few
#                decode-only steps (256 rows at about 450 tokens of context) and a few mixed prefill+decode
#                steps of the throughput workload, reduced on the machine to a text table: per step its rows,
#                tokens and contexts (the engine's own step descriptors), wall time against the bandwidth floor
#                ((parameters + every row's KV read) / HBM bandwidth: H100 3.35 TB/s, H200 4.8 TB/s; the dry
#                run states a nominal 50 GB/s), device busy and idle time, host gaps, synchronizations and
#                transfers; the host's time per engine part; the top device ops or fusions by time per step
# The log goes to $OUT/gpu_check.log when OUT is set (else /tmp/gpu_check.log), beside it the throughput JSON
# (gpu_check_throughput.json), the anchor's (gpu_check_anchor.json), both rows as a dated result file for
# docs/benchmarks/results (gpu_check_results.json) and the profile's table, numbers and raw traces
# (gpu_check_profile.txt, gpu_check_profile.json, gpu_check_profile_trace.tar.gz: XSpace and Perfetto JSON of
# each phase, under 15 MiB). Exit status: the number of failed or timed-out stages.
#
# The GPU machine reaches nothing outside itself and its image lacks `gguf` (jaxllm imports it). Before
# sending the repository there, from its root on a machine with pip:
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf
# and carry `.whl` (ignored by git): its wheels are installed into /tmp first and win over the image's.
# The stages need no model files: the parity test builds a tiny HF llama with torch (stories260K cannot
# serve on the Pallas kernels, head_dim 8 < 16), the throughput stage writes random weights.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

DRY_RUN=0
ONLY=""
while (( $# )); do
  case $1 in
    --dry-run) DRY_RUN=1 ;;
    --only) ONLY=${2:-}; shift ;;
    -h | --help) sed -n '2,/^set -uo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run] [--only STAGE,...] [--help]" >&2; exit 2 ;;
  esac
  shift
done
for s in ${ONLY//,/ }; do
  case $s in
    kernel-tests | kernel-bench | parity | throughput | anchor | profile) ;;
    *) echo "--only $ONLY: unknown stage '$s' (kernel-tests, kernel-bench, parity, throughput, anchor, profile)" >&2
       exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-/tmp}
mkdir -p "$LOG_DIR"  # the device makes $OUT; a dry run may name a folder not made yet
LOG=$LOG_DIR/gpu_check.log
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The dry run has no time limit of its own worth keeping (2 slow CPU cores): only the device's budget is real.
BUDGET=$(( DRY_RUN ? 3600 : 470 ))
START=$SECONDS
FAILED=0
SUMMARY=()

record() {  # record NAME STATUS SECONDS
  SUMMARY+=("$(printf '%-14s %-40s %5ss' "$1" "$2" "$3")")
}

skip() {  # skip NAME REASON
  echo "=== $1: SKIPPED: $2"
  record "$1" "SKIPPED: $2" 0
}

# Seconds each stage is expected to take on an H100 or H200 (docs/benchmarks/gpu.md says which are measured).
declare -A ESTIMATE=([setup]=15 [kernel-tests]=130 [kernel-bench]=45 [parity]=45 [throughput]=60 [anchor]=75
                     [profile]=90)

selected() {  # selected NAME: the stage is among --only's (all are without --only)
  [[ -z $ONLY || ",$ONLY," == *",${1// /-},"* ]]
}

stage() {  # stage NAME TIMEOUT_S COMMAND... (runs under `timeout`, clipped to what is left of the budget)
  local name=$1 limit=$2 left rc t0 status
  shift 2
  if ! selected "$name"; then
    skip "$name" "not in --only $ONLY"
    return
  fi
  left=$(( BUDGET - (SECONDS - START) ))
  (( limit > left )) && limit=$left
  if (( limit < 15 )); then
    skip "$name" "time budget spent"
    return
  fi
  echo
  echo "=== $name (timeout ${limit}s): $*"
  t0=$SECONDS
  timeout -k 10 "$limit" "$@"
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMEOUT after ${limit}s"; FAILED=$((FAILED + 1)) ;;
    *) status="FAILED (exit $rc)"; FAILED=$((FAILED + 1)) ;;
  esac
  record "$name" "$status" $((SECONDS - t0))
}

has() {  # has MODULE...: all importable
  "$PY" -c "import $(IFS=,; echo "$*")" 2>/dev/null
}

main() {
echo "gpu_check $(date -u +%FT%TZ) dry_run=$DRY_RUN${ONLY:+ only=$ONLY} log=$LOG"
TOTAL=0
for s in setup kernel-tests kernel-bench parity throughput anchor profile; do
  if [[ $s == setup ]] || selected "$s"; then TOTAL=$((TOTAL + ESTIMATE[$s])); fi
done
echo "estimate on an H100/H200: ${TOTAL} s (setup ${ESTIMATE[setup]}, kernel tests ${ESTIMATE[kernel-tests]}," \
  "kernel bench ${ESTIMATE[kernel-bench]}, parity ${ESTIMATE[parity]}, throughput ${ESTIMATE[throughput]}," \
  "anchor ${ESTIMATE[anchor]}, profile ${ESTIMATE[profile]}; each stage's own time ends the log); hard budget" \
  "${BUDGET} s"
command -v nvidia-smi >/dev/null && nvidia-smi -L

# --- setup ------------------------------------------------------------------------------------------
t0=$SECONDS
if compgen -G ".whl/*.whl" >/dev/null; then
  echo "installing carried wheels: $(ls .whl)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl \
    && export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi
BACKEND=$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null || echo none)
if [[ $BACKEND != gpu && $DRY_RUN == 0 ]]; then
  echo "JAX backend is '$BACKEND', not gpu: trying pip install -e .[cuda12]"
  timeout 120 "$PY" -m pip install -q --retries 0 --timeout 10 -e ".[cuda12]"
  BACKEND=$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null || echo none)
fi
"$PY" - <<'EOF'
import platform
import jax
print(f"Python {platform.python_version()}, JAX {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
EOF
MISSING=$(for m in numpy safetensors tokenizers gguf jinja2 xxhash tqdm prometheus_client ml_dtypes orbax.checkpoint \
            pytest hypothesis; do has "$m" || echo -n "$m "; done)
MISSING=${MISSING% }
JAXLLM_OK=0
if [[ -z $MISSING ]] && "$PY" -c "import jaxllm, kernels_pallas, scheduler"; then JAXLLM_OK=1; fi
SETUP="backend $BACKEND${MISSING:+, missing: $MISSING}"
if [[ $BACKEND != gpu && $DRY_RUN == 0 ]]; then
  SETUP="FAILED: JAX sees no GPU ($SETUP)"
  FAILED=$((FAILED + 1))
fi
record setup "$SETUP" $((SECONDS - t0))

if [[ $DRY_RUN == 1 ]]; then
  export JAXLLM_PALLAS_INTERPRET=1
elif [[ $BACKEND == gpu ]]; then
  export JAXLLM_PALLAS_INTERPRET=0
fi
# XLA's GPU command buffers: JAXLLM_XLA_COMMAND_BUFFER=default|off|all (jaxllm/worker/xla_flags.py, one place).
XLA_FLAGS=$("$PY" -m jaxllm.worker.xla_flags "${JAXLLM_XLA_COMMAND_BUFFER:-default}") && export XLA_FLAGS
echo "XLA_FLAGS=${XLA_FLAGS:-} (JAXLLM_XLA_COMMAND_BUFFER=${JAXLLM_XLA_COMMAND_BUFFER:-default})"
GPU_OK=$DRY_RUN
[[ $BACKEND == gpu ]] && GPU_OK=1

# --- kernel tests -----------------------------------------------------------------------------------
if (( ! GPU_OK )); then
  skip "kernel tests" "JAX sees no GPU"
elif ! has pytest hypothesis kernels_pallas; then
  skip "kernel tests" "pytest, hypothesis or kernels_pallas does not import"
elif (( DRY_RUN )); then
  stage "kernel tests" 600 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_pallas.py \
    tests/test_kernels_mosaic.py -k "lowering or write"
else
  # The Triton cases took 112 s on an H200 (docs/benchmarks/gpu.md); the Mosaic ones (skipped off Hopper) are
  # unmeasured.
  stage "kernel tests" 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_pallas.py \
    tests/test_kernels_mosaic.py -k "not test_kernels_mosaic or matches_reference or split_count or pallas_ops"
fi

# --- kernel bench -----------------------------------------------------------------------------------
if (( ! GPU_OK )); then
  skip "kernel bench" "JAX sees no GPU"
elif (( DRY_RUN )); then
  stage "kernel bench" 600 "$PY" scripts/bench_kernels.py --smoke --iters 1
else
  stage "kernel bench" 120 "$PY" scripts/bench_kernels.py
fi

# --- engine parity ----------------------------------------------------------------------------------
if (( ! GPU_OK )); then
  skip parity "JAX sees no GPU"
elif (( ! JAXLLM_OK )); then
  skip parity "jaxllm does not import (missing: ${MISSING:-see above})"
elif ! has torch transformers; then
  skip parity "torch or transformers missing (the test's tiny HF llama is built with them)"
elif (( DRY_RUN )); then
  stage parity 900 "$PY" -m pytest -q -p no:cacheprovider tests/test_pallas_engine.py -k float32
else
  stage parity 70 "$PY" -m pytest -q -p no:cacheprovider tests/test_pallas_engine.py
fi

# --- throughput -------------------------------------------------------------------------------------
MODEL=$WORK/qwen3_0.6b_shape
mkdir -p "$MODEL"
if (( DRY_RUN )); then
  SHAPE='"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000'
  SIZES=(--num-requests 8 --input-len 8 32 --output-len 4 16 --max-num-seqs 8 --max-num-batched-tokens 64
         --max-model-len 64 --token-buckets 16 64 --seq-buckets 4 8)
  # No bandwidth table entry for a CPU: a stated nominal 50 GB/s, so that the limit's arithmetic runs too.
  BANDWIDTH=(--bandwidth 50)
else
  SHAPE='"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936'
  # Six step programs (T x S with S <= T): the default ladders would compile ~30 programs of 28 layers each,
  # minutes of this stage's budget.
  SIZES=(--num-requests 256 --input-len 100 512 --output-len 100 256 --max-num-seqs 256
         --max-num-batched-tokens 4096 --max-model-len 1024 --token-buckets 256 1024 4096 --seq-buckets 64 256)
  BANDWIDTH=()
fi
cat > "$MODEL/config.json" <<EOF
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", $SHAPE,
 "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu",
 "tie_word_embeddings": true, "attention_bias": false}
EOF
if (( ! GPU_OK )); then
  skip throughput "JAX sees no GPU"
elif (( ! JAXLLM_OK )); then
  skip throughput "jaxllm does not import (missing: ${MISSING:-see above})"
else
  stage throughput "$(( DRY_RUN ? 900 : 160 ))" "$PY" scripts/bench_throughput.py --model "$MODEL" --random-weights \
    "${SIZES[@]}" "${BANDWIDTH[@]}" --output-json "$LOG_DIR/gpu_check_throughput.json"
fi

# --- anchor: transformers' continuous batching -------------------------------------------------------
if (( ! JAXLLM_OK )); then
  skip anchor "jaxllm does not import (missing: ${MISSING:-see above}; the random weights are written by it)"
elif ! has torch transformers; then
  skip anchor "torch or transformers missing"
elif (( ! DRY_RUN )) && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  skip anchor "torch sees no CUDA"
else
  BESIDE=()
  [[ -f $LOG_DIR/gpu_check_throughput.json ]] && BESIDE=(--jaxllm-json "$LOG_DIR/gpu_check_throughput.json")
  stage anchor "$(( DRY_RUN ? 600 : 150 ))" "$PY" scripts/bench_hf_anchor.py --model "$MODEL" --random-weights \
    "${SIZES[@]}" "${BANDWIDTH[@]}" "${BESIDE[@]}" --output-json "$LOG_DIR/gpu_check_anchor.json" \
    --results-json "$LOG_DIR/gpu_check_results.json"
fi

# --- profile ----------------------------------------------------------------------------------------
PROFILE_DIR=$WORK/profile
if (( ! GPU_OK )); then
  skip profile "JAX sees no GPU"
elif (( ! JAXLLM_OK )); then
  skip profile "jaxllm does not import (missing: ${MISSING:-see above})"
else
  if (( DRY_RUN )); then
    PROFILE_SIZES=(--decode-rows 8 --decode-context 40 --steps 3 --skip-steps 1 "${BANDWIDTH[@]}")
  else
    PROFILE_SIZES=(--decode-rows 256 --decode-context 450 --steps 4 --skip-steps 2)
  fi
  stage profile "$(( DRY_RUN ? 900 : 150 ))" "$PY" scripts/profile_trace.py --model "$MODEL" --random-weights \
    "${SIZES[@]}" "${PROFILE_SIZES[@]}" --out "$PROFILE_DIR"
  for f in profile.txt profile.json profile_trace.tar.gz; do
    [[ -f $PROFILE_DIR/$f ]] && cp "$PROFILE_DIR/$f" "$LOG_DIR/gpu_check_$f"
  done
fi

echo
echo "=== summary ($((SECONDS - START)) s of a ${BUDGET} s budget; log $LOG)"
printf '%s\n' "${SUMMARY[@]}"
return "$FAILED"
}

main 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$status"
