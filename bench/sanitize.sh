#!/usr/bin/env bash
# compute-sanitizer over every kernel family at small awkward shapes, on the GPU machine:
#
#   bench/sanitize.sh [TOOL ...]        (default: memcheck racecheck synccheck initcheck)
#
# Runs bench/sanitize_workload.py under each tool, one process per family, and
# prints each run's error summary; logs go to $OUT (./sanitize_out when unset).
# API errors are not reported: cuda-python's driver module probes entry points
# that the installed driver lacks (cuGetProcAddress), which is not a kernel's doing.
# Exits non-zero if any run reports an error (docs/sanitizers.md: what each
# family and tool reports, and how the kernels and the workload keep it so).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-./sanitize_out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
TOOLS=${*:-memcheck racecheck synccheck initcheck}
FAMILIES=${FAMILIES:-"fwd_sm80 bwd_sm80 fwd_sm90 fp8 bwd_sm90 plan score_mods varlen kvcache dropout"}
failed=0
for tool in $TOOLS; do
    for family in $FAMILIES; do
        log="$OUT/$tool-$family.log"
        compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 3 "$PYTHON" bench/sanitize_workload.py "$family" >"$log" 2>&1
        rc=$?
        summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error:" "$log" | tail -1)
        printf '%-10s %-9s exit %d  %s\n' "$tool" "$family" "$rc" "$summary"
        [ "$rc" -ne 0 ] && failed=1
    done
done
exit $failed
