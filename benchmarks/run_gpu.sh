#!/usr/bin/env bash
# The GPU pass: the `gpu`-marked tests (CUDA versions of the contract and equivalence tests, the compiled editor's
# included), then every `prisme bench` subcommand that takes --device, run with --device cuda (the workspace rows with
# the compiled editor beside eager; `long`: PRISME against dense attention at 4,096-65,536 positions, d = 256), in
# under 5 minutes.
#
#   benchmarks/run_gpu.sh                     # skips cleanly (exit 0) when CUDA is not available
#   BUDGET_S=280 ONLY="workspace" benchmarks/run_gpu.sh
#
# Each bench writes benchmarks/results/<what>_cuda_<yyyymmdd>.json (UTC date) and its table beside it as .txt.
# Budget: BUDGET_S seconds in all (default 270, under the 5-minute window); each bench gets what is left, under
# `timeout`, and a bench that would start with less than 20 s left is skipped. CPU-only benches (kv) are not run here:
# run_cpu.sh has them. Exit status: 0 when every bench that ran passed (or when CUDA is absent), else 1.
set -uo pipefail

cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "run_gpu.sh: CUDA is not available here; nothing to run (skipped)"
    exit 0
fi
"$PY" -c "import torch; print('GPU:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"

BUDGET_S=${BUDGET_S:-270}
DATE=$(date -u +%Y%m%d)
OUT=${OUT_DIR:-benchmarks/results}
mkdir -p "$OUT"
BENCHES=${ONLY:-"long workspace vs-hf train"}
# Per-bench settings sized for the window (the GPU is fast; model construction on the host dominates).
declare -A EXTRA=(
    [workspace]="--presets demo,prisme_103m --batches 1,8 --new-tokens 16 --repeats 5 --profile --compile"
    [train]="--presets demo,prisme_103m --stages workspace,controller --stage-presets demo --repeats 3 --threads -1"
    [long]="--contexts 4096,16384,65536 --batches 1,8 --steps 64 --repeats 3 --prefill"
)

has_flag() { grep -qE -- "(^|[[:space:][])$1([[:space:]]|]|$)" <<<"$help"; }

status=0
if [[ -z "${ONLY:-}" ]]; then  # the gpu tests first, within 60 s of the budget
    echo "== gpu tests: $PY -m pytest -q -m gpu tests"
    timeout --signal=INT --kill-after=10 60 "$PY" -m pytest -q -m gpu tests | tee "$OUT/gpu_tests_cuda_${DATE}.txt"
    [[ ${PIPESTATUS[0]} -ne 0 ]] && status=1
fi
for what in $BENCHES; do
    help=$("$PY" -m prisme bench "$what" --help 2>/dev/null)
    if [[ -z "$help" ]]; then
        echo "== $what: not in this checkout, skipped"
        continue
    fi
    if ! has_flag --device; then
        echo "== $what: no --device flag (CPU only), skipped"
        continue
    fi
    left=$((BUDGET_S - SECONDS))
    if (( left < 20 )); then
        echo "== $what: only ${left} s of the ${BUDGET_S} s budget left, skipped"
        status=1
        continue
    fi
    # shellcheck disable=SC2206
    args=(--device cuda --json "$OUT/${what}_cuda_${DATE}.json" ${EXTRA[$what]:-})
    echo "== $what: $PY -m prisme bench $what ${args[*]} (timeout ${left} s)"
    start=$SECONDS
    timeout --signal=INT --kill-after=10 "$left" "$PY" -m prisme bench "$what" "${args[@]}" \
        | sed '/^{$/,$d' | tee "$OUT/${what}_cuda_${DATE}.txt"
    rc=${PIPESTATUS[0]}
    echo "== $what: exit $rc after $((SECONDS - start)) s"
    [[ $rc -ne 0 ]] && status=1
done
echo "run_gpu.sh: ${SECONDS} s in all (budget ${BUDGET_S} s)"
exit $status
