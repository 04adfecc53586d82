"""``python -m cuflash bench [options]``: cuflash against its peers, in TFLOP/s from one run.

Forward (the default), on the shapes of cuflash.bench.shapes. Each shape is
checked for correctness once (cuflash against torch's flash backend, or
against a float32 CuPy reference when torch is missing), then timed for
cuflash and its peers:

* ``naive-cupy``: unfused attention in CuPy, in the input dtype: a batched
  cuBLAS GEMM writes the N x N scores, a row softmax, a second GEMM;
* ``torch-flash`` / ``torch-cudnn``: ``scaled_dot_product_attention`` pinned to
  the FlashAttention-2 or cuDNN backend, on zero-copy views of the same data.

With ``--tuned`` a ``cuflash-tuned`` column shows cuflash with autotuned
configurations next to ``cuflash`` on the heuristic table alone (shapes that
the tuning cache lacks are tuned first, outside the timed calls).

With ``--backward`` the timed call is one forward (``return_lse=True``) plus
one backward for a fixed random output gradient, counted as 3.5 forward
passes of FLOPs, on the same shapes:

* ``cuflash`` / ``cuflash-det``: ``cuflash.attention_backward`` with
  ``deterministic=False`` / ``True`` (the ``det cost`` column is the time of
  the second over the first);
* ``torch-flash`` / ``torch-cudnn``: SDPA on that backend, then
  ``torch.autograd.grad`` with respect to leaf-tensor views of the inputs.

There is no naive column in this mode. Each shape is checked once: cuflash's
and cuflash-det's dq, dk, dv against torch-flash's (against a float32 CuPy
backward on one batch entry and a few heads when torch is missing), and two
cuflash-det calls must give bitwise identical gradients.

With ``--fp8``: cuflash.bench.fp8. With ``--varlen``: cuflash.bench.varlen. With ``--ring``:
cuflash.bench.ring.

With ``--window``, ``--softcap`` or ``--alibi`` (flash-attn's options, in any
combination; cuflash.bench.variants) every shape times, forward or
forward+backward:

* ``cuflash+opts`` (and ``cuflash-det+opts`` with ``--backward``): cuflash
  with the options, checked against the float32 CuPy reference with them
  (torch has none of them);
* ``cuflash``: the plain kernel on the same shape (full or causal), the
  baseline where no peer takes an option;
* ``jax-cudnn``: ``jax.nn.dot_product_attention`` on cuDNN with
  ``local_window_size``, when JAX is installed and the option is a window
  with right = 0 (causal, or LEFT,0) and nothing else.

With ``--dropout P`` (0 < P < 1; it combines with those options) every
shape times, forward or forward+backward:

* ``cuflash+opts`` (and ``cuflash-det+opts``): ``dropout_p=P`` with a fixed
  seed and offset, passed to the forward and the backward alike;
* ``cuflash``: the plain kernel on the same shape, so that opts/plain is the
  cost of dropout;
* ``torch-flash`` / ``torch-cudnn``: SDPA on that backend with ``dropout_p=P``,
  when dropout is the only option (a backend that refuses a shape is not run).

Every library draws a mask of its own, so no output is compared: cuflash's
output must be finite (with ``--backward``: cuflash's and cuflash-det's
gradients, and two cuflash-det calls must give identical bits).

A windowed call's FLOPs count only the (query, key) pairs its mask lets
through, exactly; dropout's FLOPs are the plain shape's. There is no memory
section in a run with options.

The result is a table of TFLOP/s on stdout (progress goes to stderr), an
optional JSON file with every raw number, and a table of the peak extra
memory of one call. The exit status is non-zero if cuflash failed or
disagreed with the reference on any shape.
"""

from __future__ import annotations

import argparse
import sys

from .options import dtype_option, list_option, seqlen_option
from .shapes import DTYPES, HEADDIMS, QUICK_SEQLENS, SEQLENS
from .variants import Variant, dropout_option, window_and_softcap


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m cuflash bench",
        description="Attention benchmark: cuflash vs naive CuPy and torch SDPA (forward), "
                    "or cuflash vs torch SDPA (forward+backward, --backward).",
    )
    parser.add_argument("--backward", action="store_true",
                        help="time forward+backward (one forward with lse + one backward) instead "
                             "of the forward alone; cuflash, cuflash-det (deterministic=True), "
                             "torch-flash and torch-cudnn; gradients are checked against torch-flash "
                             "and cuflash-det for bitwise reproducibility")
    parser.add_argument("--fp8", action="store_true",
                        help="fp8 e4m3 forward (Hopper): cuflash-fp8 next to cuflash and torch-cudnn on "
                             "bf16 inputs, then fp8 and bf16 errors against float64")
    parser.add_argument("--varlen", action="store_true",
                        help="packed batches of different lengths (attention_varlen): cuflash next to "
                             "cuflash on the padded batch, torch's FlashAttention-2 varlen kernels and JAX's cuDNN "
                             "attention with sequence lengths")
    parser.add_argument("--decode", action="store_true",
                        help="one decoding step over a KV cache (attention_with_kvcache): GB/s of cache read "
                             "for contiguous and paged caches next to torch SDPA flash and cuDNN")
    parser.add_argument("--ring", action="store_true",
                        help="ring attention over every GPU present (NCCL) against one GPU, 32k-512k tokens, "
                             "with the share of the transfers hidden; needs two or more GPUs")
    parser.add_argument("--nccl-channels", type=int, metavar="N",
                        help="with --ring: NCCL's channels (NCCL_MAX_NCHANNELS and NCCL_MAX_P2P_NCHANNELS) for "
                             "this run; fewer leave more SMs to the attention kernels (docs/distributed.md)")
    parser.add_argument("--decode-nq", type=int, default=1, metavar="N",
                        help="new queries per decoding step (causal when more than 1) (default: 1)")
    parser.add_argument("--graphs", action="store_true",
                        help="with --decode: device time of steps replayed from CUDA graphs, as a generation "
                             "loop replays them, instead of eager calls (whose events hold a short step's launch)")
    parser.add_argument("--headdim", action="append", metavar="D",
                        help="head dimension(s), e.g. 64,128 (default: both)")
    parser.add_argument("--seqlen", action="append", metavar="N",
                        help="sequence length(s), e.g. 512,2k,16k (default: 512..16k)")
    parser.add_argument("--dtype", action="append", metavar="T",
                        help="fp16 and/or bf16 (default: both)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                        help="only causal (--causal) or only non-causal (--no-causal) shapes")
    parser.add_argument("--quick", action="store_true",
                        help="seqlen 2k and 8k only (unless --seqlen is given)")
    parser.add_argument("--repeats", type=int, default=30,
                        help="timed calls per library and shape; the median is reported "
                             "(fewer for very slow calls) (default: 30)")
    parser.add_argument("--no-peers", action="store_true",
                        help="time cuflash only (and cuflash-det with --backward); torch-flash is "
                             "still the correctness reference")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory section")
    parser.add_argument("--tuned", action="store_true",
                        help="add a cuflash-tuned column (autotuned configs; shapes missing from the "
                             "tuning cache are tuned first); the cuflash column then uses the heuristic "
                             "table only (forward only: ignored with --backward)")
    parser.add_argument("--window", metavar="LEFT,RIGHT",
                        help="sliding window: query i sees keys i-LEFT..i+RIGHT; one number W means W,W; "
                             "-1 leaves a side unbounded (write --window=-1,0); causal shapes run with "
                             "RIGHT = 0. Times cuflash with the window next to plain cuflash and "
                             "jax-cudnn (JAX's cuDNN attention: RIGHT = 0 only)")
    parser.add_argument("--softcap", type=float, default=0.0, metavar="C",
                        help="soft cap of the scaled scores, s -> C tanh(s / C), e.g. 30; times "
                             "cuflash with it next to plain cuflash (no peer has it)")
    parser.add_argument("--alibi", action="store_true",
                        help="ALiBi biases with the standard slopes 2^(-8(h+1)/H); times cuflash with "
                             "them next to plain cuflash (no peer has them)")
    parser.add_argument("--dropout", type=float, metavar="P",
                        help="dropout on the attention probabilities, 0 < P < 1, fixed seed and offset; times "
                             "cuflash with it next to plain cuflash and torch-flash and torch-cudnn with "
                             "dropout_p=P (dropout alone); outputs are only checked to be finite, since every "
                             "library draws its own mask")
    parser.add_argument("--json", metavar="PATH", help="write all raw numbers to PATH")
    args = parser.parse_args(argv)

    args.headdims = list_option(parser, args.headdim, int, "--headdim") or list(HEADDIMS)
    args.dtypes = list_option(parser, args.dtype, dtype_option, "--dtype") or list(DTYPES)
    default_seqlens = QUICK_SEQLENS if args.quick else SEQLENS
    args.seqlens = list_option(parser, args.seqlen, seqlen_option, "--seqlen") or list(default_seqlens)
    args.masks = [False, True] if args.causal is None else [args.causal]
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.nccl_channels is not None and args.nccl_channels < 1:
        parser.error("--nccl-channels must be at least 1")
    if args.graphs and not args.decode:
        parser.error("--graphs times decoding steps: it goes with --decode")
    if any(n <= 0 for n in args.seqlens):
        parser.error("--seqlen values must be positive")
    for d in args.headdims:
        if not 8 <= d <= 256 or d % 8:
            parser.error(f"--headdim {d}: expected a multiple of 8 in 8..256")
    args.variant = _variant(parser, args)
    return args


def _variant(parser, args) -> Variant:
    """The options of --window, --softcap, --alibi and --dropout; a usage error where they are invalid or
    cannot combine."""
    window, softcap = window_and_softcap(parser, args.window, args.softcap)
    variant = Variant(window, softcap, args.alibi, dropout_option(parser, args.dropout))
    if variant.has_score_options and (args.fp8 or args.tuned):
        parser.error("--window, --softcap and --alibi do not combine with --fp8 or --tuned")
    modes = {"--fp8": args.fp8, "--tuned": args.tuned, "--varlen": args.varlen, "--decode": args.decode,
             "--ring": args.ring}
    refused = [switch for switch, given in modes.items() if given]
    if variant.dropout > 0 and refused:
        parser.error(f"--dropout does not combine with {', '.join(refused)}")
    return variant


def main(argv=None) -> int:
    args = parse_args(argv)
    # CuPy, torch and the kernels load only past option parsing: --help needs none of them.
    if args.ring:
        from .ring import run as run_ring

        return run_ring(args)
    if args.decode:
        from .decode import run as run_decode

        return run_decode(args)
    if args.varlen:
        from .varlen import run as run_varlen

        return run_varlen(args)
    from .run import run

    return run(args, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
