"""Same-run A/B of split decoding's two merges: the kernel's last split CTA merging
the splits (tiles of up to decode_launch.MERGE_IN_KERNEL_ROWS rows) against the
combine kernel, on the same shapes and split counts.

Usage (on a GPU):  PYTHONPATH=. python bench/decode_merge_ab.py [--rounds 3]

fp16, head dim 128, 32 query heads (cuflash.bench.decode's steps). The two
paths alternate for `rounds` rounds (each a fresh plan, 20 timed calls over 4
input sets); a path's figure is its best round's median. Prints GB/s of cache
read, its share of the device copy rate, µs per call, and the largest
difference between the two outputs.
"""

from __future__ import annotations

import argparse

import cupy

from cuflash import decode_launch, kv_cache, timing
from cuflash.bench.decode import Step, copy_rate_gbs
from cuflash.bench.measure import device_info

# (kind, kv heads, batch, cache tokens): the split shapes of the decode bench near or under 0.9 of
# the copy rate, and two unsplit ones as controls.
SHAPES = [("GQA", 8, 8, 8192), ("GQA", 8, 1, 131072), ("MHA", 32, 1, 32768), ("MQA", 1, 64, 8192),
          ("MQA", 1, 8, 131072), ("GQA", 8, 64, 1024), ("MHA", 32, 8, 1024), ("GQA", 8, 8, 32768)]
INPUT_SETS, REPEATS = 4, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("device", device_info()["name"])
    copy = copy_rate_gbs(REPEATS)
    print(f"copy rate {copy:.0f} GB/s")
    paths = {"merge": decode_launch.MERGE_IN_KERNEL_ROWS, "combine": 0}
    for kind, nheads_kv, batch, cache in SHAPES:
        steps = [Step(batch, cache, nheads_kv, 1, cupy.float16, seed=s) for s in range(INPUT_SETS)]
        best, outs, splits = {}, {}, {}
        for _ in range(args.rounds):
            for path, rows in paths.items():
                decode_launch.MERGE_IN_KERNEL_ROWS = rows
                kv_cache._plans.clear()  # the next call plans its launch under this setting
                fns = [s.contiguous() for s in steps]
                outs[path] = fns[0]().copy()
                launch = next(iter(kv_cache._plans.plans.values())).launch
                splits[path] = (launch.num_splits, launch.merge_in_kernel)
                best[path] = min(best.get(path, float("inf")), timing.median_ms(fns, REPEATS))
        decode_launch.MERGE_IN_KERNEL_ROWS = paths["merge"]
        gbs = {path: steps[0].bytes / (ms * 1e-3) / 1e9 for path, ms in best.items()}
        diff = float(cupy.abs(outs["merge"].astype(cupy.float32) - outs["combine"].astype(cupy.float32)).max())
        print(f"{kind} batch {batch} cache {cache}: splits {splits['merge'][0]}, merged in the kernel "
              f"{splits['merge'][1]}; merge {gbs['merge']:.0f} GB/s ({gbs['merge'] / copy:.3f}) "
              f"{best['merge'] * 1e3:.1f} us, combine {gbs['combine']:.0f} GB/s ({gbs['combine'] / copy:.3f}) "
              f"{best['combine'] * 1e3:.1f} us, max diff {diff:.2e}")
        del steps, outs
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
