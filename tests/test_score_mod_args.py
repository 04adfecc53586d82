"""The struct kernel parameters as cuflash packs them (ScoreModArgs, KVCacheArgs, CombineArgs) have the
C++ structs' sizes, and the varlen row layouts hold every sequence. NVRTC, no GPU."""

import numpy as np
import pytest

from cuflash import compile as cf_compile
from cuflash import launch
from cuflash.config import BWD_ROW_PAD
from cuflash.decode_launch import COMBINE_ARGS_DTYPE, KV_CACHE_ARGS_DTYPE
from cuflash.dispatch import BwdProblem
from cuflash.score_mods import KERNEL_ARGS_DTYPE, ScoreMods, Varlen

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


@pytest.mark.parametrize("header, struct, dtype", [("score_mods.cuh", "ScoreModArgs", KERNEL_ARGS_DTYPE),
                                                   ("kv_cache.cuh", "KVCacheArgs", KV_CACHE_ARGS_DTYPE),
                                                   ("combine.cuh", "CombineArgs", COMBINE_ARGS_DTYPE)])
def test_kernel_args_have_the_struct_size(header, struct, dtype):
    """The packed words are as many bytes as the C++ struct (NVRTC has no offsetof; the fields'
    order is the struct's, written out in each dtype)."""
    try:
        nvrtc.getVersion()
    except Exception:
        pytest.skip("no NVRTC library on this machine")
    check = f"static_assert(sizeof(cuflash::{struct}) == {dtype.itemsize}, \"size\");\n"
    source = cf_compile._inline(cf_compile.cuda_src_dir() / header, set()) + check
    prog = nvrtc.createProgram(source, "args.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*cf_compile.COMPILE_OPTIONS, "-arch=compute_80"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def test_varlen_kernel_args_carry_the_batch():
    mods = ScoreMods(varlen=Varlen(num_seqs=5, total_q=1000, total_k=700))
    args = np.frombuffer(mods.kernel_args(300, 200, 0.1).tobytes(), KERNEL_ARGS_DTYPE)[0]
    assert (args["total_q"], args["total_k"], args["num_seqs"]) == (1000, 700, 5)
    assert args["cu_seqlens_q"] == 0 and args["cu_seqlens_k"] == 0  # pointed per call


@pytest.mark.parametrize("seed", range(5))
def test_varlen_row_buffers_hold_every_sequence(seed):
    """Sequence b's padded rows, from round_down(q0 + b * PAD, PAD), never overlap the next one's and end
    within the rows per head (cuda_src/seq_span.cuh)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 700, rng.integers(1, 40))
    cu = np.concatenate([[0], np.cumsum(lengths)])
    problem = BwdProblem("float16", 64, False, int(lengths.max(initial=1)), 64, 1, False,
                         mods=ScoreMods(varlen=Varlen(len(lengths), int(cu[-1]), 64)))
    per_head, rows = launch.buffer_rows(problem, (1, int(cu[-1]), 3, 64))  # the launches' packed view
    assert rows == 3 * per_head and per_head % BWD_ROW_PAD == 0
    starts = [(cu[b] + b * BWD_ROW_PAD) // BWD_ROW_PAD * BWD_ROW_PAD for b in range(len(lengths))]
    ends = [s + -(-n // BWD_ROW_PAD) * BWD_ROW_PAD for s, n in zip(starts, lengths)]
    assert all(e <= s for e, s in zip(ends, starts[1:]))
    assert max(ends) <= per_head
