#!/usr/bin/env bash
# GPU verification in one call, run from the repository root on the GPU machine:
#
#   bench/device_check.sh [bench options...]      e.g. bench/device_check.sh --quick
#
# Steps: list the GPUs and print the environment, self-check the kernels, run
# the GPU tests, then benchmark the forward and then forward+backward (extra
# arguments go to both benchmarks). A failing step does not stop the later
# ones, so one call always yields benchmark numbers; the exit status is
# non-zero if any step failed. Logs, bench.json and bench_bwd.json go to $OUT
# (./bench_out when OUT is unset): 7 files, info.log check.log tests.log
# bench.log bench.json bench_bwd.log bench_bwd.json.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1

OUT=${OUT:-./bench_out}
mkdir -p "$OUT"
# On the GPU machine "python3" is the interpreter that has torch.
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}

failed=()

# step NAME COMMAND...: run COMMAND, tee its output to $OUT/NAME.log, record failure.
step() {
    local name=$1
    shift
    echo
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        # pytest exits 5 when no test was collected: worth a warning, not a failure.
        if [ "$name" = tests ] && [ "$rc" -eq 5 ]; then
            echo "=== $name: no tests collected"
        else
            echo "=== $name: FAILED (exit $rc)"
            failed+=("$name")
        fi
    fi
}

# nvidia-smi and cuflash info share one log; fails if either fails.
gpus_and_info() {
    nvidia-smi -L
    local rc=$?
    "$PYTHON" -m cuflash info || return
    return $rc
}

step info gpus_and_info
step check "$PYTHON" -m cuflash check --arch sm_90
step tests "$PYTHON" -m pytest -q -m gpu tests
step bench "$PYTHON" -m cuflash bench --json "$OUT/bench.json" "$@"
step bench_bwd "$PYTHON" -m cuflash bench --backward --json "$OUT/bench_bwd.json" "$@"

echo
if [ ${#failed[@]} -ne 0 ]; then
    echo "device_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "device_check: all steps passed"
