"""The last wave of the persistent Hopper forward, split along the keys (cuda_src/tail_split.cuh).

Without a causal mask every work tile costs the same, so when the tile count
is not a multiple of the CTA count the last wave leaves CTAs idle for a whole
tile's time. The split keeps the full waves' tiles whole and deals the key
blocks of the rest into up to one run per CTA; runs of at least
MIN_ITEM_BLOCKS key blocks, and a split only where its longest run plus
SEGMENT_COST beats a whole tile.
"""

from __future__ import annotations

import dataclasses

# Key blocks per run at least: a run pays for its pipeline's fill and drain,
# its partial output's round trip and, for one run per tile, the combine.
MIN_ITEM_BLOCKS = 4
# Those costs, in key blocks, where the split weighs its gain. Measured with
# ncu on an H100, 68 tiles of 8k keys on 132 SMs (one wave, all split): 66 µs
# split against 96 whole for fp8 at head dim 128 (192-key blocks, ~2.1 µs
# each), 78 against 116 for fp16 (128-key blocks, ~1.8 µs): 6-10 blocks more
# than the runs' 23 and 33 blocks, of which the combine 2-3.
SEGMENT_COST = 8


@dataclasses.dataclass(frozen=True)
class TailSplit:
    full_tiles: int  # tiles taken whole (the first ones)
    items: int  # runs the other tiles' key blocks are dealt into; 0: no split

    def split_tiles(self, num_tiles: int) -> int:
        return num_tiles - self.full_tiles

    def slots(self, num_tiles: int) -> int:
        """Workspace slots for partial outputs: run index + split tile index, so at most this many (tail_split.cuh)."""
        return self.items + self.split_tiles(num_tiles) if self.items else 0


def plan(num_tiles: int, ctas: int, key_blocks: int) -> TailSplit:
    """The split of `num_tiles` tiles of `key_blocks` key blocks each over `ctas` persistent CTAs."""
    whole = TailSplit(num_tiles, 0)
    split = num_tiles % ctas
    if split == 0 or key_blocks < MIN_ITEM_BLOCKS:
        return whole
    # items >= split (key_blocks >= MIN_ITEM_BLOCKS): a run touches at most two tiles.
    items = min(ctas, split * key_blocks // MIN_ITEM_BLOCKS)
    longest = -(-split * key_blocks // items)
    if longest + SEGMENT_COST >= key_blocks:
        return whole
    return TailSplit(num_tiles - split, items)
