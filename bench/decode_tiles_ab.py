"""Same-run A/B of the decoding kernel's tiles for 17-32 packed rows: 8 warps (2 on the rows by 4 on
the keys, one CTA an SM: dispatch.decode_config and decode_slots) against 4 warps (2 by 2, two CTAs
an SM, the split rule counting both), on the same steps.

Usage (on a GPU):  PYTHONPATH=. python bench/decode_tiles_ab.py [--rounds 3] [--page-size N]

fp16, head dim 128, 32 query heads (cuflash.bench.decode's steps): MQA at 1 query, GQA (8 kv
heads) at 8 causal queries, and two 4-row controls that both arms run alike. The arms alternate
for `rounds` rounds (each a fresh plan, 20 timed calls over 4 input sets); an arm's figure is its
best round's median; with --page-size, over a paged copy of each cache (pages of N tokens, the
table shuffled). Prints warps, splits, GB/s of cache read and its share of the device copy
rate, µs per call, and the largest difference from the 4-warp output.
"""

from __future__ import annotations

import argparse

import cupy

from cuflash import dispatch, kv_cache, timing
from cuflash.bench.decode import Step, copy_rate_gbs
from cuflash.bench.measure import device_info
from cuflash.config import DecodeConfig

# (kind, kv heads, batch, cache tokens, queries)
SHAPES = [("MQA", 1, 1, 8192, 1), ("MQA", 1, 8, 8192, 1), ("MQA", 1, 8, 32768, 1), ("MQA", 1, 8, 131072, 1),
          ("MQA", 1, 64, 1024, 1), ("MQA", 1, 64, 8192, 1), ("MQA", 1, 64, 32768, 1), ("MQA", 1, 64, 131072, 1),
          ("GQA", 8, 8, 8192, 8), ("GQA", 8, 64, 8192, 8), ("GQA", 8, 8, 32768, 8),
          ("GQA", 8, 8, 8192, 1), ("MHA", 32, 8, 8192, 1)]
INPUT_SETS, REPEATS = 4, 20


def four_warp_config(headdim: int, rows: int, max_smem: int, fp8: bool = False) -> DecodeConfig:
    cfg = EIGHT_WARPS[0](headdim, rows, max_smem, fp8)
    return DecodeConfig(cfg.headdim, cfg.warps_m, 4 // cfg.warps_m, cfg.stages, fp8)


def resident_slots(cfg: DecodeConfig, resident_per_sm: int, sms: int) -> int:
    return resident_per_sm * sms


EIGHT_WARPS = (dispatch.decode_config, dispatch.decode_slots)
ARMS = {"4 warps": (four_warp_config, resident_slots), "8 warps": EIGHT_WARPS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=0, help="0: contiguous caches")
    parser.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES (default: all)")
    args = parser.parse_args()
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    print("device", device_info()["name"])
    copy = copy_rate_gbs(REPEATS)
    print(f"copy rate {copy:.0f} GB/s")
    for kind, nheads_kv, batch, cache, nq in shapes:
        steps = [Step(batch, cache, nheads_kv, nq, cupy.float16, seed=s) for s in range(INPUT_SETS)]
        best, launch_of, outs = {}, {}, {}
        for _ in range(args.rounds):
            for arm, (config, slots) in ARMS.items():
                dispatch.decode_config, dispatch.decode_slots = config, slots
                kv_cache._plans.clear()  # the next call plans its launch with this arm's choices
                fns = [s.paged(args.page_size) if args.page_size else s.contiguous() for s in steps]
                outs[arm] = fns[0]().copy()
                launch = next(iter(kv_cache._plans.plans.values())).launch
                launch_of[arm] = (launch.threads // 32, launch.num_splits)
                best[arm] = min(best.get(arm, float("inf")), timing.median_ms(fns, REPEATS))
        dispatch.decode_config, dispatch.decode_slots = EIGHT_WARPS
        line = f"{kind} batch {batch} cache {cache} queries {nq}:"
        for arm, ms in best.items():
            gbs = steps[0].bytes / (ms * 1e-3) / 1e9
            diff = float(cupy.abs(outs[arm].astype(cupy.float32) - outs["4 warps"].astype(cupy.float32)).max())
            warps, splits = launch_of[arm]
            line += (f" | {warps} warps, {splits} splits: {gbs:.0f} GB/s ({gbs / copy:.3f}) {ms * 1e3:.1f} us,"
                     f" diff {diff:.1e}")
        print(line, flush=True)
        del steps, outs
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
