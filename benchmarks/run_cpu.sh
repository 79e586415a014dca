#!/usr/bin/env bash
# Every `prisme bench` subcommand this checkout has (kv, workspace, vs-hf, train), on CPU, with its default protocol.
#
#   benchmarks/run_cpu.sh                    # all of them
#   ONLY="kv workspace" benchmarks/run_cpu.sh
#   THREADS=1 benchmarks/run_cpu.sh          # pass --threads 1 to every bench that takes it (shared machines)
#   QUICK=1 benchmarks/run_cpu.sh            # pass --quick where a bench has it (smoke run)
#   OUT_DIR=/tmp/res benchmarks/run_cpu.sh   # write the results elsewhere
#
# Each bench writes benchmarks/results/<what>_cpu_<yyyymmdd>.json (--json; UTC date) and its table to
# benchmarks/results/<what>_cpu_<yyyymmdd>.txt; the console shows the tables. Exit status: 0 when every bench
# ran and passed its checks, else 1 (the others still run). Python: $PYTHON, else .venv/bin/python, else python.
set -uo pipefail

cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python
fi
DATE=$(date -u +%Y%m%d)
OUT=${OUT_DIR:-benchmarks/results}
mkdir -p "$OUT"
BENCHES=${ONLY:-"kv workspace vs-hf train"}

# The --help of a subcommand (empty when the subcommand does not exist in this checkout), and whether it lists a flag
# exactly (--threads is not --threads-big).
help_of() { "$PY" -m prisme bench "$1" --help 2>/dev/null; }
has_flag() { grep -qE -- "(^|[[:space:][])$1([[:space:]]|]|$)" <<<"$help"; }

status=0
for what in $BENCHES; do
    help=$(help_of "$what")
    if [[ -z "$help" ]]; then
        echo "== $what: not in this checkout (prisme bench $what), skipped"
        continue
    fi
    args=(--json "$OUT/${what}_cpu_${DATE}.json")
    [[ "$what" == workspace ]] && args+=(--profile)
    if [[ -n "${THREADS:-}" ]]; then
        has_flag --threads && args+=(--threads "$THREADS")
        has_flag --threads-small && args+=(--threads-small "$THREADS")
        has_flag --threads-big && args+=(--threads-big "$THREADS")
    fi
    [[ -n "${QUICK:-}" ]] && has_flag --quick && args+=(--quick)
    has_flag --device && args+=(--device cpu)
    echo "== $what: $PY -m prisme bench $what ${args[*]}"
    start=$SECONDS
    # The table (everything before the JSON document, which goes to the file) to the console and a .txt beside it.
    "$PY" -m prisme bench "$what" "${args[@]}" | sed '/^{$/,$d' | tee "$OUT/${what}_cpu_${DATE}.txt"
    rc=${PIPESTATUS[0]}
    echo "== $what: exit $rc after $((SECONDS - start)) s"
    [[ $rc -ne 0 ]] && status=1
done
exit $status
