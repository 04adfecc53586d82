"""The split of the Hopper forward's last wave (cuflash/tail_split.py): when
it applies, and that the kernel's partition of the split tiles' key blocks
(cuda_src/tail_split.cuh, restated here) covers each key block once, in runs
of at most two segments, with distinct workspace slots."""

import pytest

from cuflash import tail_split
from cuflash.dispatch import HEURISTIC_SM90
from cuflash.score_mods import MOD_ALIBI, MOD_SOFTCAP, MOD_VARLEN, MOD_WINDOW


def kernel_slot_range(split, num_tiles, key_blocks, k):
    """The slots [first, last] the combine of split tile k reads, as tail_slots computes them."""
    units = split.split_tiles(num_tiles) * key_blocks

    def item_of(x):
        return ((x + 1) * split.items - 1) // units

    return item_of(k * key_blocks) + k, item_of((k + 1) * key_blocks - 1) + k


def kernel_segments(split, num_tiles, key_blocks):
    """The segments (tile, lo, hi, slot) of each item, as tail_segment computes them."""
    split_tiles = split.split_tiles(num_tiles)
    units = split_tiles * key_blocks
    for j in range(split.items):
        begin, end = j * units // split.items, (j + 1) * units // split.items
        segments, part, more = [], 0, True
        while more:
            k = begin // key_blocks + part
            lo = begin - k * key_blocks if part == 0 else 0
            hi = min(key_blocks, end - k * key_blocks)
            segments.append((split.full_tiles + k, lo, hi, j + k))
            more, part = end > (k + 1) * key_blocks, part + 1
        yield segments


@pytest.mark.parametrize("num_tiles,ctas,key_blocks", [(2048, 132, 43), (2048, 132, 16), (2048, 132, 8),
                                                       (200, 132, 64), (64, 132, 16), (36, 5, 9), (37, 3, 12),
                                                       (1, 132, 1000)])
def test_partition_covers_every_key_block_once(monkeypatch, num_tiles, ctas, key_blocks):
    monkeypatch.setattr(tail_split, "SEGMENT_COST", 0)  # split even where it gains little
    split = tail_split.plan(num_tiles, ctas, key_blocks)
    assert split.items > 0
    assert split.items <= ctas and split.full_tiles % ctas == 0
    seen = {}
    slots = set()
    for segments in kernel_segments(split, num_tiles, key_blocks):
        assert 1 <= len(segments) <= 2
        assert sum(hi - lo for _, lo, hi, _ in segments) >= tail_split.MIN_ITEM_BLOCKS
        for tile, lo, hi, slot in segments:
            assert split.full_tiles <= tile < num_tiles and 0 <= lo < hi <= key_blocks
            assert slot not in slots and 0 <= slot < split.slots(num_tiles)
            slots.add(slot)
            for n in range(lo, hi):
                assert (tile, n) not in seen
                seen[tile, n] = slot
    assert len(seen) == split.split_tiles(num_tiles) * key_blocks
    for k in range(split.split_tiles(num_tiles)):
        first, last = kernel_slot_range(split, num_tiles, key_blocks, k)
        tile_slots = {slot for (tile, _), slot in seen.items() if tile == split.full_tiles + k}
        assert tile_slots == set(range(first, last + 1))


@pytest.mark.parametrize("num_tiles,ctas,key_blocks", [(2112, 132, 43), (264, 132, 8), (2048, 132, 3),
                                                       (2048, 132, 11), (2048, 132, 16), (131, 132, 43)])
def test_no_split(num_tiles, ctas, key_blocks):
    """Whole waves, too few key blocks to split, or runs whose cost eats their gain."""
    split = tail_split.plan(num_tiles, ctas, key_blocks)
    assert split == tail_split.TailSplit(num_tiles, 0)
    assert split.slots(num_tiles) == 0


def test_split_shortens_the_last_wave():
    """2048 tiles on 132 CTAs (the benchmark's 16k tokens): 68 tiles in the last wave, dealt to all CTAs."""
    split = tail_split.plan(2048, 132, 43)
    assert split == tail_split.TailSplit(2048 - 68, 132)
    assert tail_split.plan(2048, 132, 86) == tail_split.TailSplit(2048 - 68, 132)


def test_which_hopper_forwards_split():
    # FwdSm90Config.tail_split mirrors the kernel's TAIL_SPLIT: equal-length persistent tiles below head
    # dim 256, and ALiBi's column GEMM only at head dim 64.
    d64, d128, d256 = HEURISTIC_SM90[64], HEURISTIC_SM90[128], HEURISTIC_SM90[256]
    assert d64.tail_split("float16", False, 0) and d128.tail_split("bfloat16", False, 0)
    assert not d128.tail_split("float16", True, 0)
    assert not any(d128.tail_split("float16", False, mods) for mods in (MOD_WINDOW, MOD_VARLEN))
    assert not d256.tail_split("float16", False, 0)
    assert d64.tail_split("float16", False, MOD_ALIBI) and not d128.tail_split("float16", False, MOD_ALIBI)
    assert d128.tail_split("float16", False, MOD_ALIBI | MOD_SOFTCAP)  # softcap: no column GEMM
