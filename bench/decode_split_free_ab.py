"""Same-run A/B of the decoding steps whose row blocks fill half the SMs or more over a 16-bit cache,
and of the wgmma tiles' steps below that: the tree's choice (dispatch.decode_split_count: unsplit, or
one wave of splits) against decode_splits' wave rule (bench/decode_ab.py: device time of CUDA-graph
replays next to torch-cudnn; fp16, head dim 128, 32 query heads).

Usage (on a GPU):  PYTHONPATH=. python bench/decode_split_free_ab.py [--rounds 4] [--page-size N]
"""

from __future__ import annotations

import contextlib
from unittest import mock

from cuflash import dispatch

from decode_ab import main

# (kv heads, batch, cache tokens, queries, e4m3 cache): 72-120 row blocks of the 16-row tile (32 on 8,
# 4 and 2, MHA), of the 32-row tile (MQA with one query, 32 on 8 with 8 causal queries) and of the
# wgmma tiles (MQA with 2 and 4 causal queries, 32 on 4 with 8) over 1k-32k caches; then steps the rule
# leaves alone (fewer row blocks: clusters; e4m3 caches; a step of 12 row blocks).
STEPS = [(8, b, c, 1, False) for b in (9, 12) for c in (1024, 4096, 32768)]
STEPS += [(4, 24, c, 1, False) for c in (1024, 4096)]
STEPS += [(2, b, c, 1, False) for b in (36, 48) for c in (1024, 8192)]
STEPS += [(32, 3, c, 1, False) for c in (1024, 8192)]
STEPS += [(1, b, c, 1, False) for b in (72, 96, 120) for c in (1024, 4096)]
STEPS += [(8, b, c, 8, False) for b in (9, 12) for c in (1024, 4096)]
STEPS += [(1, b, c, q, False) for q in (2, 4) for b in (72, 120) for c in (4096, 16384)]  # the wgmma tiles
STEPS += [(4, b, c, 8, False) for b in (18, 30) for c in (4096, 16384)]
# below half the SMs the wgmma tiles split into one wave
STEPS += [(1, b, c, 4, False) for b in (36, 60) for c in (4096, 16384)] + [(4, 9, 4096, 8, False)]
STEPS += [(1, 4, 65536, 4, False)]
STEPS += [(8, 8, 8192, 1, False), (1, 96, 4096, 1, True), (1, 12, 4096, 16, False)]


def wave_rule(cfg, ctas, key_blocks, slots, sms, paged):
    return dispatch.decode_splits(ctas, key_blocks, slots)


def split_by_waves():
    """A block within which every step takes decode_splits' count (the rule before decode_split_count)."""
    return mock.patch.object(dispatch, "decode_split_count", wave_rule)


if __name__ == "__main__":
    main(__doc__, STEPS, {"decode_splits": split_by_waves, "tree": contextlib.nullcontext})
