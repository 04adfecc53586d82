"""Same-run A/B of the decoding steps of 17-32 packed rows a kv head over short caches: the tree's
choice (two row blocks of the 16-row tile where dispatch.decode_halves_rows and one wave allow) against
the 32-row tile's plan for every step (bench/decode_ab.py: device time of CUDA-graph replays next to
torch-cudnn; fp16, head dim 128, 32 query heads).

Usage (on a GPU):  PYTHONPATH=. python bench/decode_halved_rows_ab.py [--rounds 4] [--page-size N]
"""

from __future__ import annotations

import contextlib
from unittest import mock

from cuflash import dispatch

from decode_ab import main

# (kv heads, batch, cache tokens, queries, e4m3 cache): MQA with one query and 32 on 8 with 8 causal
# queries (32 rows a kv head) over 1k-8k caches; e4m3 caches keep the 32-row tile.
STEPS = [(1, b, c, 1, False) for b in (1, 8, 16, 32, 48, 50, 64) for c in (1024, 2048)]
STEPS += [(8, b, c, 8, False) for b in (1, 2, 4, 6, 8) for c in (1024, 2048)]
STEPS += [(1, 64, 8192, 1, False), (8, 8, 8192, 8, False), (1, 64, 1024, 1, True)]


def thirty_two_row_tile():
    """A block within which no step leaves the 32-row tile for two row blocks of the 16-row one."""
    return mock.patch.object(dispatch, "decode_halves_rows", lambda *args: False)


if __name__ == "__main__":
    main(__doc__, STEPS, {"32-row tile": thirty_two_row_tile, "tree": contextlib.nullcontext})
