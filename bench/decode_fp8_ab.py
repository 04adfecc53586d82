"""Same-run A/B of decoding over an fp8 (e4m3) cache against the fp16 cache of the same shape, and of
the fp8 kernel's ring size (48 / 64 KB) and split rule (8 or 12 warps an SM).

Usage (on a GPU of compute capability 8.9 or later):  PYTHONPATH=. python bench/decode_fp8_ab.py

fp16 q, head dim 128, 32 query heads, one query (cuflash.bench.decode's steps). Per arm, the best of
2 rounds of medians over 20 calls; GB/s count the bytes of the cache read (the fp8 cache's half).
Prints warps and splits per arm, and whether the fp8 outputs are finite.
"""

from __future__ import annotations

import cupy

from cuflash import dispatch, kv_cache, timing
from cuflash.bench.decode import Step, copy_rate_gbs
from cuflash.bench.measure import device_info

# (kind, kv heads, batch, cache tokens)
SHAPES = [("MHA", 32, 8, 8192), ("MHA", 32, 1, 32768), ("GQA", 8, 8, 8192), ("GQA", 8, 1, 131072),
          ("GQA", 8, 64, 8192), ("MQA", 1, 64, 8192), ("MQA", 1, 8, 131072), ("MHA", 32, 1, 1024)]
# arm -> (fp8 cache, fp8 ring bytes, warps an SM for the split rule)
ARMS = {"fp16": (False, None, None), "fp8 48K": (True, 48 * 1024, 8), "fp8 64K": (True, 64 * 1024, 8),
        "fp8 48K 12 warps": (True, 48 * 1024, 12)}
INPUT_SETS, REPEATS, ROUNDS = 3, 20, 2


def main() -> None:
    print("device", device_info()["name"])
    print(f"copy rate {copy_rate_gbs(REPEATS):.0f} GB/s")
    defaults = dispatch.DECODE_RING_BYTES_FP8, dispatch.DECODE_WARPS_PER_SM
    for kind, nheads_kv, batch, cache in SHAPES:
        steps = [Step(batch, cache, nheads_kv, 1, cupy.float16, seed=s) for s in range(INPUT_SETS)]
        best, launch_of, finite = {}, {}, True
        for _ in range(ROUNDS):
            for arm, (fp8, ring, warps) in ARMS.items():
                dispatch.DECODE_RING_BYTES_FP8 = ring or defaults[0]
                dispatch.DECODE_WARPS_PER_SM = warps or defaults[1]
                kv_cache._plans.clear()  # the next call plans its launch with this arm's choices
                fns = [s.fp8() if fp8 else s.contiguous() for s in steps]
                finite &= bool(cupy.isfinite(fns[0]()).all())
                launch = next(iter(kv_cache._plans.plans.values())).launch
                launch_of[arm] = f"{launch.threads // 32} warps, {launch.num_splits} splits"
                best[arm] = min(best.get(arm, float("inf")), timing.median_ms(fns, REPEATS))
        dispatch.DECODE_RING_BYTES_FP8, dispatch.DECODE_WARPS_PER_SM = defaults
        line = f"{kind} batch {batch} cache {cache}:"
        for arm, ms in best.items():
            read = steps[0].bytes // (2 if ARMS[arm][0] else 1)
            line += f" | {arm} ({launch_of[arm]}) {ms * 1e3:.1f} us {read / (ms * 1e-3) / 1e9:.0f} GB/s"
        print(line, "" if finite else "NON-FINITE OUTPUT", flush=True)
        del steps
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
