"""The driver of `python -m cuflash bench` (forward and forward+backward; --fp8 hands over to fp8.main):
load the libraries, check and time every shape, measure memory, print the tables, write the JSON."""

from __future__ import annotations

import datetime

import cupy

import cuflash

from ..tune_common import HIDDEN
from . import fp8, fwd, fwd_bwd, memory, tables
from .inputs import MiB
from .libs import Cuflash, CuflashFwdBwd, NaiveCupy, load_jax_libs, load_torch_libs
from .measure import device_info, log, release_memory
from .shapes import BWD_FLOPS_FACTOR, SHORT_DTYPE, TOKENS, build_shapes


def run(args, argv: list) -> int:
    """Run the benchmark for cli.parse_args's `args`; 0 if every cuflash row passed, 1 if not, 2 without a GPU."""
    try:
        device = device_info()
    except Exception as exc:
        log(f"cuflash bench: no CUDA device ({type(exc).__name__}: {exc})")
        return 2
    if args.fp8:
        return fp8.main(args, device)
    if args.backward and args.tuned:
        log("cuflash bench: --tuned applies to the forward benchmark only; ignored with --backward")
        args.tuned = False
    tuned = Cuflash("tuned") if args.tuned else None
    variant = args.variant
    mine, timed, torch_libs = _variant_libraries(args) if variant.enabled else _libraries(args, tuned)
    # A run with options has no torch reference: torch has no window, soft cap or ALiBi, and no two libraries
    # draw one dropout mask. The float32 CuPy reference serves, or with dropout a check that results are finite.
    reference = None if variant.enabled else next((lib for lib in torch_libs if lib.name == "torch-flash"), None)

    report = {
        "mode": "fwd+bwd" if args.backward else "fwd",
        "device": device,
        "versions": {
            "cuflash": cuflash.__version__,
            "cupy": cupy.__version__,
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "torch": torch_libs[0].torch.__version__ if torch_libs else None,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": argv,
        "repeats": args.repeats,
        "libraries": [lib.name for lib in timed],
        "results": [],
        "memory": [],
    }
    if variant.enabled:
        report["options"] = variant.to_json()
        report["versions"]["jax"] = next((lib.jax.__version__ for lib in timed if lib.name == "jax-cudnn"), None)
    if args.backward:
        report["flops_per_forward_flop"] = BWD_FLOPS_FACTOR
        report["grad_tolerance"] = {"rel": fwd_bwd.GRAD_REL, "atol": fwd_bwd.GRAD_ATOL}
    log(f"device: {device['name']} (sm_{device['compute_capability']}, "
        f"{device['sm_count']} SMs, L2 {device['l2_bytes'] / MiB:.0f} MiB; NVRTC {device['nvrtc']}); "
        f"{report['mode']}{'; ' + variant.describe() if variant.enabled else ''}; "
        f"libraries: {', '.join(report['libraries'])}")

    shapes = build_shapes(args.dtypes, args.headdims, args.masks, args.seqlens)
    for i, shape in enumerate(shapes, 1):
        if args.backward:
            row = fwd_bwd.run_shape_bwd(shape, timed, reference, args.repeats, device["l2_bytes"])
            verdict = tables.bwd_verdict(row, [lib.name for lib in mine[:2]])
        else:
            row = fwd.run_shape(shape, timed, reference, args.repeats, device["l2_bytes"], tuned)
            verdict = "; ".join(tables.verdict(row[c]) + ("" if c == "check" else " (tuned)")
                                for c in ("check", "check_tuned") if c in row)
        release_memory(torch_libs)
        report["results"].append(row)
        tables.write_json(args.json, report)  # keep partial results if the run is cut short
        log(f"[{i}/{len(shapes)}] {SHORT_DTYPE[shape.dtype]} d={shape.headdim} "
            f"{'causal' if shape.causal else 'full'} N={shape.seqlen} B={shape.batch} "
            f"H={shape.heads}: " + ", ".join(
                f"{name} {tables.cell(r)}" for name, r in row["libs"].items()) + f"; {verdict}")
        for name, r in row["libs"].items():
            if "error" in r or "skipped" in r:
                log(f"    {name}: {r.get('error') or 'skipped: ' + r['skipped']}")

    if not args.no_memory and not variant.enabled:
        if args.backward:
            report["memory"] = memory.run_memory_bwd(mine if args.no_peers else [*mine, *torch_libs])
        else:
            report["memory"] = memory.run_memory([mine[0]] if args.no_peers else [
                mine[0], NaiveCupy(max_seqlen=None), *torch_libs])
        release_memory(torch_libs)

    failed = [r for r in report["results"] if not r["ok"]]
    mem_failed = [m for m in report["memory"]
                  if any("error" in m["libs"].get(lib.name, {}) for lib in mine if lib is not tuned)]
    report["ok"] = not failed and not mem_failed
    tables.write_json(args.json, report)
    _print_tables(args, device, report)
    if failed or mem_failed:
        print(f"\nFAILED: {len(failed)} cuflash row(s) failed or mismatched"
              + (f", {len(mem_failed)} memory measurement(s) failed" if mem_failed else ""))
        return 1
    return 0


def _libraries(args, tuned) -> tuple[list, list, list]:
    """(mine, timed, torch peers) for a run without options."""
    if args.backward:
        mine = [CuflashFwdBwd(deterministic=False), CuflashFwdBwd(deterministic=True)]
    else:
        mine = [Cuflash("heuristic" if args.tuned else None)] + ([tuned] if tuned else [])
    # torch is loaded even with --no-peers: its flash backend is the reference.
    torch_libs = load_torch_libs(log, backward=args.backward)
    if args.no_peers:
        return mine, mine, torch_libs
    return mine, [*mine, *torch_libs] if args.backward else [*mine, NaiveCupy(), *torch_libs], torch_libs


def _variant_libraries(args) -> tuple[list, list, list]:
    """(mine, timed, torch peers) for a run with options: cuflash with them (cuflash-det too with
    --backward), plain cuflash, torch SDPA for dropout alone, and the JAX peer for a window without dropout."""
    variant = args.variant
    if args.backward:
        mine = [CuflashFwdBwd(False, variant), CuflashFwdBwd(True, variant), CuflashFwdBwd()]
    else:
        mine = [Cuflash(variant=variant), Cuflash()]
    torch_libs = _dropout_peers(args)
    jax_libs = (load_jax_libs(log, variant, args.backward)
                if variant.has_window and variant.dropout == 0 and not args.no_peers else [])
    return mine, [*mine, *torch_libs, *jax_libs], torch_libs


def _dropout_peers(args) -> list:
    """torch SDPA's flash and cuDNN backends with the run's dropout_p, where dropout is its only option
    (torch has no window, soft cap or ALiBi); none otherwise."""
    variant = args.variant
    if args.no_peers or variant.dropout == 0 or variant.has_score_options:
        return []
    return load_torch_libs(log, args.backward, variant.dropout)


def _print_tables(args, device, report) -> None:
    dash = tables.DASH
    if args.variant.enabled:
        _print_variant_table(args, device, report)
    elif args.backward:
        print(f"\nForward+backward TFLOP/s on {device['name']}: median of up to {args.repeats} calls "
              f"(one forward with lse + one backward; FLOPs = {BWD_FLOPS_FACTOR} x forward); "
              f"batch x seqlen = {TOKENS}, hidden {HIDDEN}.  "
              f"'!' gradients mismatch, 'NONDET' cuflash-det not bitwise reproducible, "
              f"'ERR' failed, '{dash}' not run; det cost = cuflash-det time / cuflash time.")
        print(tables.bwd_speed_table(report["results"]))
    else:
        print(f"\nForward TFLOP/s on {device['name']}: median of up to {args.repeats} calls; "
              f"batch x seqlen = {TOKENS}, hidden {HIDDEN}.  "
              f"'!' cuflash mismatch, 'ERR' cuflash failed, '{dash}' not run.")
        print(tables.speed_table(report["results"]))
    heads, headdim = memory.MEMORY_HEADS, memory.MEMORY_HEADDIM
    if report["memory"] and args.backward:
        print(f"\nPeak extra device memory of one forward+backward call, MiB "
              f"(fp16, batch 1, {heads} heads, hdim {headdim}, non-causal). "
              f"Inputs q+k+v ('inputs') and dout are excluded; each peak includes the returned "
              f"gradients dq+dk+dv ('grads') and the forward's out and lse. "
              f"'N x N' is the size of one fp16 score matrix per head, for scale:")
        print(tables.bwd_memory_table(report["memory"]))
    elif report["memory"]:
        print(f"\nPeak extra device memory of one forward call, MiB "
              f"(fp16, batch 1, {heads} heads, hdim {headdim}, non-causal; 'inputs' is q+k+v):")
        print(tables.memory_table(report["memory"]))


def _variant_notes(variant) -> tuple[str, str]:
    """The variant table's notes on its peers and on what a '!' means."""
    if variant.dropout > 0:
        return (f"torch-flash and torch-cudnn: SDPA on that backend with dropout_p={variant.dropout:g} "
                "(with dropout alone); dropout counts the plain shape's FLOPs",
                "non-finite results (dropout: each library draws its own mask, so none is compared)")
    return ("jax-cudnn: jax.nn.dot_product_attention on cuDNN, timed on the host around each call",
            "mismatch with the float32 CuPy reference")


def _print_variant_table(args, device, report) -> None:
    variant = args.variant
    mode = (f"Forward+backward (FLOPs = {BWD_FLOPS_FACTOR} x forward; det: deterministic=True)"
            if args.backward else "Forward")
    peers, mark = _variant_notes(variant)
    print(f"\n{mode} TFLOP/s on {device['name']} with {variant.describe()}: median of up to "
          f"{args.repeats} calls; batch x seqlen = {TOKENS}, hidden {HIDDEN}.  "
          f"cuflash: the plain kernel (no options); windowed calls count only the visible (query, key) "
          f"pairs ('visible' of N x N, exact); opts/plain and opts/<peer>: TFLOP/s ratios; {peers}.  "
          f"'!' {mark}, 'ERR' failed, '{tables.DASH}' not run.")
    print(tables.variant_speed_table(report["results"], args.backward, tables.variant_peers(variant)))
