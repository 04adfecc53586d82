#!/usr/bin/env bash
# GPU verification, run from the repository root on the GPU machine:
#
#   bench/device_check.sh [tests|bench|all|verify|ring|fuzz]      (default: all)
#
# tests: list the GPUs and print the environment, compile every shipped kernel
#        and read the Hopper fast paths' SASS (check --sass: wgmma instructions,
#        no local memory), and run the GPU tests;
# verify: what a kernel change runs before it lands, in one call: check
#        (sm_90), the four sanitizers over every family (bench/sanitize.sh, a
#        process per tool) and the GPU tests (a process per test file, 8 at a
#        time) all at once, then the hardening tests alone (their leak bound
#        and no-synchronisation check must not share the GPU); every log in
#        $OUT/verify.log;
# ring: on a machine with several GPUs, the ring attention tests (one
#        process, a process per GPU, JAX shard_map), then bench --ring
#        forward and forward+backward, with NCCL's default channels and with
#        2 (docs/distributed.md);
# fuzz: the long fuzz runs of tests/test_fuzz_gpu.py (CUFLASH_FUZZ_CASES, default
#        5,000) and the KV-cache cases they imply (a quarter), each in
#        FUZZ_PROCS processes (default: one per core, less one) of one BLAS
#        thread each (blas_threads); FUZZ_FROM takes a run up again at a case;
# bench: the forward benchmark (every default shape), forward+backward
#        (--quick), head dim 256 (bf16), and fp8 (head dims 128 and 256,
#        2k-16k).
# A failing step does not stop the later ones, so one call always yields
# benchmark numbers; the exit status is non-zero if any step failed. Logs and
# the benchmarks' JSON go to $OUT (./bench_out when OUT is unset). The two
# halves fit one 10-minute call each on an H200.
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

# blas_threads N: at most N BLAS threads in each process started from here on (in this shell). The
# tests' float64 references are many small products: processes that each started a thread per core
# slowed the long fuzz run about 3x (bench/PERFLOG.md).
blas_threads() {
    export OMP_NUM_THREADS=$1 OPENBLAS_NUM_THREADS=$1 MKL_NUM_THREADS=$1
}

# verify_tests LOGS: each test file's GPU tests in a process of its own, 8 at a time (the cores
# shared among them), the hardening file left out; a line per file with pytest's summary; fails if a
# file fails (pytest's exit 5, no GPU test in the file, is not a failure).
verify_tests() {
    blas_threads $(($(nproc) > 8 ? $(nproc) / 8 : 1))
    ls tests/test_*.py | grep -v test_hardening_gpu.py | xargs -P 8 -I{} sh -c '
        log="$2/$(basename "$1" .py).log"
        "$0" -m pytest -q -p no:cacheprovider -m gpu "$1" >"$log" 2>&1
        rc=$?; [ $rc -eq 5 ] && rc=0
        echo "$1: exit $rc: $(tail -n 1 "$log")"
        exit $rc' "$PYTHON" {} "$1"
}

# verify_sanitizers LOGS: bench/sanitize.sh with each tool in a process of its own; fails if any reports.
# With several GPUs they run on the last, away from the tests.
verify_sanitizers() {
    local rc=0 pids=() tool pid gpus last
    gpus=$(nvidia-smi -L | wc -l)
    last=$((gpus > 1 ? gpus - 1 : 0))
    for tool in memcheck racecheck synccheck initcheck; do
        CUDA_VISIBLE_DEVICES=$last OUT="$1/sanitize" bench/sanitize.sh "$tool" >"$1/sanitize-$tool.txt" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    cat "$1"/sanitize-*.txt
    return $rc
}

# fuzz_shards FILE: FILE's GPU tests in $FUZZ_PROCS processes (CUFLASH_FUZZ_SHARD), each with one BLAS
# thread; a line per process with pytest's summary; fails if any process fails.
fuzz_shards() {
    local name rc=0 pids=() i procs=${FUZZ_PROCS:-$(($(nproc) > 1 ? $(nproc) - 1 : 1))}
    name=$(basename "$1" .py)
    blas_threads 1
    for ((i = 0; i < procs; i++)); do
        CUFLASH_FUZZ_SHARD=$i/$procs "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu "$1" -k fuzz \
            >"$OUT/$name-$i.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    for ((i = 0; i < procs; i++)); do echo "$name $i/$procs: $(tail -n 1 "$OUT/$name-$i.log")"; done
    return $rc
}

MODE=${1:-all}
if [ "$MODE" = verify ]; then
    logs=$(mktemp -d)
    step info gpus_and_info
    "$PYTHON" -m cuflash check --arch sm_90 --sass >"$logs/check.log" 2>&1 &
    check_pid=$!
    verify_sanitizers "$logs" >"$logs/sanitizers.txt" 2>&1 &
    sanitizers_pid=$!
    step tests verify_tests "$logs"
    wait "$check_pid" || failed+=(check)
    echo; echo "=== check"; grep -E "FAIL|kernels compiled" "$logs/check.log"
    wait "$sanitizers_pid" || failed+=(sanitizers)
    echo; echo "=== sanitizers"; cat "$logs/sanitizers.txt"
    step hardening "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/test_hardening_gpu.py
    cat "$logs"/*.log "$logs/sanitizers.txt" >"$OUT/verify.log"
    rm -rf "$logs"
fi
if [ "$MODE" = ring ]; then
    step info gpus_and_info
    step tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/test_distributed.py tests/test_jax_gpu.py -k "ring"
    step ring "$PYTHON" -m cuflash bench --ring --seqlen 32k,128k,512k --repeats 5 --json "$OUT/ring.json"
    step ring_2ch "$PYTHON" -m cuflash bench --ring --seqlen 128k,512k --repeats 5 --nccl-channels 2 \
        --json "$OUT/ring_2ch.json"
    step ring_bwd "$PYTHON" -m cuflash bench --ring --backward --seqlen 128k --repeats 3 --json "$OUT/ring_bwd.json"
    step ring_bwd_2ch "$PYTHON" -m cuflash bench --ring --backward --seqlen 128k --repeats 3 --nccl-channels 2 \
        --json "$OUT/ring_bwd_2ch.json"
fi
if [ "$MODE" = fuzz ]; then
    export CUFLASH_FUZZ_CASES=${CUFLASH_FUZZ_CASES:-5000} CUFLASH_FUZZ_FROM=${FUZZ_FROM:-0}
    step fuzz fuzz_shards tests/test_fuzz_gpu.py
    step fuzz_kvcache fuzz_shards tests/test_kvcache_gpu.py
fi
if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
    step info gpus_and_info
    step check "$PYTHON" -m cuflash check --arch sm_90 --sass
    step tests "$PYTHON" -m pytest -q -m gpu tests
fi
if [ "$MODE" = bench ] || [ "$MODE" = all ]; then
    step bench "$PYTHON" -m cuflash bench --json "$OUT/bench.json"
    step bench_bwd "$PYTHON" -m cuflash bench --backward --quick --json "$OUT/bench_bwd.json"
    step bench_256 "$PYTHON" -m cuflash bench --headdim 256 --dtype bf16 --no-memory --json "$OUT/bench_256.json"
    step bench_fp8 "$PYTHON" -m cuflash bench --fp8 --headdim 128 --headdim 256 --seqlen 2k,8k,16k \
        --json "$OUT/bench_fp8.json"
fi

echo
if [ ${#failed[@]} -ne 0 ]; then
    echo "device_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "device_check: all steps passed"
