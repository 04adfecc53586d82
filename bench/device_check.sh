#!/usr/bin/env bash
# GPU verification in one call, run from the repository root on the GPU machine:
#
#   bench/device_check.sh [bench options...]      e.g. bench/device_check.sh --quick
#
# Steps: list the GPUs, print the environment, self-check the kernels, run the
# GPU tests, then benchmark (extra arguments go to the benchmark). A failing
# step does not stop the later ones, so one call always yields benchmark
# numbers; the exit status is non-zero if any step failed. Logs and bench.json
# go to $OUT (./bench_out when OUT is unset).
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

step gpus nvidia-smi -L
step info "$PYTHON" -m cuflash info
step check "$PYTHON" -m cuflash check --arch sm_90
step tests "$PYTHON" -m pytest -q -m gpu tests
step bench "$PYTHON" -m cuflash bench --json "$OUT/bench.json" "$@"

echo
if [ ${#failed[@]} -ne 0 ]; then
    echo "device_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "device_check: all steps passed"
