#!/usr/bin/env bash
# The one prepared device run (issue 18, item 5; docs/gpu.md): environment, install, the
# model-oracle tests on CUDA in float32 and bfloat16, `batchgen bench` (lockstep vs coalesce,
# bf16, CUDA graphs on), decode with CUDA graphs vs --enforce-eager, the per-kernel
# micro-benchmark, the Triton kernels' tests compiled for the GPU, and $OUT/summary.md with
# every stage's status.
#
#   bash benchmarks/gpu_check.sh              # on the device machine (OUT set by the `run` tool)
#   bash benchmarks/gpu_check.sh --dry-run    # here: every stage on CPU, tiny sizes, no install
#
# Each stage runs under `timeout` (its cap, and never past the total budget of
# GPU_CHECK_BUDGET_S, default 480 s); a failed stage does not stop the later ones; a stage
# with no budget left is recorded as skipped. At most 8 files come back from $OUT: summary.md,
# log.txt, stages.tsv, junit-fp32.xml, junit-bf16.xml, bench.json, bench.txt, kernels.json.
set -u

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
[ "${DEVICE:-}" = "cpu" ] && DRY=1
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
if [ "$DRY" = 1 ] && [ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ]; then
    PY="$ROOT/.venv/bin/python"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
BUDGET="${GPU_CHECK_BUDGET_S:-480}"
START=$(date +%s)
LOG="$OUT/log.txt"
STAGES="$OUT/stages.tsv"
: >"$LOG"
printf 'stage\tstatus\trc\tseconds\tcap_s\n' >"$STAGES"
WORK="$(mktemp -d /tmp/gpu_check.XXXXXX)"

if [ "$DRY" = 1 ]; then
    DEV=cpu; BF16=bfloat16
    ORACLE_K='(llama and not mqa and not tied and not d64) and not preemption'
    BENCH_ARGS="--device cpu --dtype float32 --workloads rollouts --rollouts-requests 4"
    KERNEL_ARGS="--device cpu --tiny --moe-paths reference --attention-backends torch"
    # The suite runs the whole modules; here the slowest tests (the engines) are left to it.
    TRITON_K='not compile_for_hopper and not engine_on_the_triton'
    GRAPHS_ARGS="--device cpu --dtype float32 --dry-run --requests 8 --max-tokens 12 --rounds 1"
    CAPS=(env=30 install=60 oracle_fp32=120 oracle_bf16=120 bench=120 graphs=120 kernels=60
          triton=120)
else
    DEV=cuda; BF16=bfloat16
    ORACLE_K=''
    BENCH_ARGS="--device cuda --dtype bfloat16 --workloads rollouts,extraction,search"
    KERNEL_ARGS="--device cuda"
    TRITON_K=''
    GRAPHS_ARGS="--device cuda --dtype bfloat16 --requests 32 --max-tokens 48 --rounds 2"
    CAPS=(env=45 install=45 oracle_fp32=110 oracle_bf16=110 bench=120 graphs=120 kernels=90
          triton=90)
fi
cap_of() { local kv; for kv in "${CAPS[@]}"; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done; }

# stage NAME CMD...: run CMD under timeout min(cap, budget left - 10 s for the summary);
# record status ok / failed (rc) / timeout / skipped (no budget left) in stages.tsv.
stage() {
    local name="$1"; shift
    local cap left t0 rc status
    cap=$(cap_of "$name")
    left=$(( BUDGET - ($(date +%s) - START) - 10 ))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 5 ]; then
        printf '%s\tskipped (budget)\t-\t0\t%s\n' "$name" "$cap" >>"$STAGES"
        echo "=== $name: skipped, total budget ${BUDGET}s spent" | tee -a "$LOG"
        return 0
    fi
    echo "=== $name (cap ${cap}s): $*" | tee -a "$LOG"
    t0=$(date +%s)
    # The stages are shell functions: exported, each runs in a child bash under timeout.
    timeout -k 5 "$cap" bash -c '"$@"' stage "$@" >>"$LOG" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" "$cap" >>"$STAGES"
    echo "=== $name: $status (rc $rc, $(( $(date +%s) - t0 ))s)" | tee -a "$LOG"
}

env_stage() {
    uname -a; nproc
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
    "$PY" - <<'EOF'
import importlib, sys
import torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    print(f"device {p.name} capability {p.major}.{p.minor} SMs {p.multi_processor_count} "
          f"free {free / 2**30:.1f} / {total / 2**30:.1f} GiB")
    print("bf16 supported", torch.cuda.is_bf16_supported())
# Runtime and test imports (pip name: module). Missing ones are listed, not fatal here: the
# summary names them; docs/gpu.md says which to carry as wheels.
mods = {"torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers",
        "safetensors": "safetensors", "huggingface_hub": "huggingface_hub", "tqdm": "tqdm",
        "PyYAML": "yaml", "pydantic": "pydantic", "jinja2": "jinja2", "numpy": "numpy",
        "psutil": "psutil", "fastapi": "fastapi", "uvicorn": "uvicorn", "httpx": "httpx",
        "prometheus_client": "prometheus_client", "python-multipart": "multipart",
        "fsspec": "fsspec", "llguidance": "llguidance", "pytest": "pytest",
        "pytest-timeout": "pytest_timeout", "triton": "triton"}
missing = []
for pip_name, mod in mods.items():
    try:
        m = importlib.import_module(mod)
        print(f"import {mod}: ok {getattr(m, '__version__', '')}")
    except Exception as exc:
        missing.append(pip_name)
        print(f"import {mod}: MISSING ({type(exc).__name__}: {exc})")
print("MISSING_IMPORTS:", " ".join(missing) if missing else "none")
EOF
}

install_stage() {
    if [ -d "$ROOT/.whl" ] && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$ROOT"/.whl/*.whl || return 1
    fi
    if [ "$DRY" = 1 ]; then  # never touch this machine's environment: resolve only
        "$PY" -m pip install --no-deps --no-build-isolation --dry-run -e "$ROOT"
    else
        "$PY" -m pip install --no-deps --no-build-isolation -e "$ROOT"
    fi
}
# Carried wheels land in /tmp/site (install_stage); later stages import from there.
[ "$DRY" = 1 ] || export PYTHONPATH="$PYTHONPATH:/tmp/site"

oracle_stage() {  # oracle_stage TAG DTYPE
    local k=()
    [ -n "$ORACLE_K" ] && k=(-k "$ORACLE_K")
    BATCHGEN_TEST_DEVICE=$DEV BATCHGEN_TEST_DTYPE=$2 "$PY" -m pytest tests/test_model_oracle.py \
        -x -q -p no:cacheprovider --timeout 120 "${k[@]}" --junitxml "$OUT/junit-$1.xml"
}

bench_stage() {
    local model=()
    if [ "$DRY" = 1 ]; then
        "$PY" -m batchgen make-model --arch mixtral --out "$WORK/tiny" >/dev/null || return 1
        model=(--model "$WORK/tiny")
    fi
    # shellcheck disable=SC2086  # BENCH_ARGS: flags without spaces, split on purpose
    "$PY" -m batchgen bench --quick $BENCH_ARGS "${model[@]}" --modes lockstep,coalesce \
        --no-progress --json >"$OUT/bench.json" || return 1
    "$PY" -c "import json, sys; from batchgen.bench.report import format_table; \
print(format_table(json.load(open(sys.argv[1]))))" "$OUT/bench.json" | tee "$OUT/bench.txt"
}

# CUDA graphs (on by default: the stages above ran with them): the fp32 token-identity test,
# the no-host-sync check of a step under torch's sync debug mode, then against --enforce-eager decode-only tokens/s of each on the bench model, alternated; one
# DECODE_GRAPHS line in log.txt, read by the summary. The dry run captures with the CPU
# stand-in backend (the CUDA test skips).
graphs_stage() {
    # Real capture and replay in fp32 against --enforce-eager, token for token (skipped on CPU).
    "$PY" -m pytest tests/test_cuda_graphs.py -q -rfEs -p no:cacheprovider --timeout 100 \
        -k cuda_graphs_on_cuda
    local rc=$?
    # No host sync from a step's inputs to its logits, eager and replayed (torch's detector).
    "$PY" -m pytest tests/test_step_host_syncs.py -q -rfEs -p no:cacheprovider --timeout 100 \
        -k on_cuda || rc=1
    # shellcheck disable=SC2086
    "$PY" benchmarks/decode_graphs.py $GRAPHS_ARGS || return 1
    return $rc
}

kernels_stage() {
    # shellcheck disable=SC2086
    "$PY" benchmarks/gpu_kernels.py $KERNEL_ARGS --out "$OUT/kernels.json" >/dev/null
}

# The Triton kernels against their torch oracles: compiled on the GPU in fp32, fp16 and bf16
# (the module picks CUDA when it is there), under TRITON_INTERPRET=1 on CPU in the dry run.
# Its outcome is in log.txt (-rfE names failures) and stages.tsv: no junit, 8 files at most.
triton_stage() {
    local k=()
    [ -n "$TRITON_K" ] && k=(-k "$TRITON_K")
    "$PY" -m pytest tests/test_triton_kernels.py tests/test_triton_mla.py -q -rfE -p no:cacheprovider --timeout 120 "${k[@]}"
}

export DRY OUT ROOT PY DEV ORACLE_K BENCH_ARGS GRAPHS_ARGS KERNEL_ARGS TRITON_K WORK
export -f env_stage install_stage oracle_stage bench_stage graphs_stage kernels_stage triton_stage
echo "gpu_check: dry_run=$DRY device=$DEV out=$OUT budget=${BUDGET}s python=$PY" | tee -a "$LOG"
stage env env_stage
stage install install_stage
stage oracle_fp32 oracle_stage fp32 float32
stage oracle_bf16 oracle_stage bf16 "$BF16"
stage bench bench_stage
stage graphs graphs_stage
stage kernels kernels_stage
stage triton triton_stage
"$PY" benchmarks/gpu_check_summary.py "$OUT" --dry-run "$DRY" --total-s "$(( $(date +%s) - START ))" \
    || echo "summary writer failed (rc $?): see stages.tsv" | tee -a "$OUT/summary.md"
rm -rf "$WORK"
cat "$OUT/summary.md"
