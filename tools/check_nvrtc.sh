#!/usr/bin/env bash
# `python -m cuflash check` under the NVRTC that an install with another extra brings (no GPU needed):
# a fresh virtual environment with the package and that extra, the check run outside the source tree.
# CI builds with the cuda12 extra (NVRTC 12.9); the cuda13 extra brings the newest NVRTC 13 wheel,
# whose ptxas may allocate registers otherwise (bench/PERFLOG.md, "ALiBi's column GEMM under NVRTC
# 13.5"), so a kernel change runs this too.
#   tools/check_nvrtc.sh [EXTRA [CHECK ARGS...]]     (default: cuda13 --arch sm_90)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
extra=${1:-cuda13}
shift || true
[ $# -gt 0 ] || set -- --arch sm_90
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/pip" install -q "$repo[$extra]"
cd "$venv"
"$venv/bin/python" -c "from cuflash.compile import nvrtc_version; print('NVRTC', nvrtc_version())"
"$venv/bin/python" -m cuflash check "$@"
