"""Run by tests/test_distributed.py on a machine with several GPUs: ring attention with one process
per GPU, as a multi-process job launches it. The parent draws a NCCL unique id and starts a process
per rank; each makes its GPU current, builds its communicator from the id (cuflash.distributed
.communicator), runs the ring forward and backward on its shard of one seeded problem and checks
its shard against the float64 reference (2x rule). Exits non-zero if any rank fails."""

import multiprocessing
import sys

import numpy as np

LAYOUT, CAUSAL = "zigzag", True


def rank_main(world: int, rank: int, uid) -> None:
    import cupy

    from cuflash import distributed, reference
    from tests.numerics import ATOL, assert_close_2x, randn, ring_rounding

    cupy.cuda.Device(rank).use()
    transport = distributed.NcclTransport([distributed.communicator(world, rank, uid)], [rank])
    rng = np.random.default_rng(world)  # every rank draws the same global problem
    n, dtype = 61 * 2 * world, np.float16
    q = randn(rng, (1, n, 4, 128), dtype)
    k, v = (randn(rng, (1, n, 1, 128), dtype) for _ in range(2))
    dout = randn(rng, q.shape, dtype)
    mine = [cupy.asarray(distributed.shard(x, rank, world, LAYOUT)) for x in (q, k, v, dout)]
    (out,), (lse,) = distributed.ring_attention(*([x] for x in mine[:3]), transport=transport, causal=CAUSAL,
                                                layout=LAYOUT, return_lse=True)
    grads = distributed.ring_attention_backward([mine[3]], *([x] for x in mine[:3]), [out], [lse],
                                                transport=transport, causal=CAUSAL, layout=LAYOUT)
    rows = distributed.shard_positions(n, rank, world, LAYOUT)
    atol = ATOL[np.dtype(dtype)]
    naive = reference.attention_naive_lowp(q, k, v, causal=CAUSAL, dtype=dtype)
    assert_close_2x(out.get(), reference.attention(q, k, v, causal=CAUSAL)[:, rows], naive[:, rows], atol)
    wants = reference.attention_backward(dout, q, k, v, causal=CAUSAL)
    naives = reference.attention_backward_naive_lowp(dout, q, k, v, causal=CAUSAL, dtype=dtype)
    for (got,), want, naive in zip(grads, wants, naives):
        assert_close_2x(got.get(), want[:, rows], naive[:, rows], atol + ring_rounding(world, want, dtype))
    print(f"rank {rank} of {world}: forward and gradients match", flush=True)


if __name__ == "__main__":
    from cuflash import distributed

    world = int(sys.argv[1])
    uid = distributed.unique_id()
    context = multiprocessing.get_context("spawn")  # CUDA does not survive a fork
    ranks = [context.Process(target=rank_main, args=(world, rank, uid)) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=300)
    for process in ranks:
        if process.is_alive():  # a rank left waiting on a failed peer
            process.terminate()
            process.join()
    codes = [process.exitcode for process in ranks]
    print(f"exit codes {codes}")
    sys.exit(0 if codes == [0] * world else 1)
