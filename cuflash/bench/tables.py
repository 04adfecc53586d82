"""What the benchmark prints: TFLOP/s and memory tables, per-row verdicts; and its JSON report."""

from __future__ import annotations

import json

from .checks import GRAD_NAMES
from .shapes import SHORT_DTYPE, seqlen_label

DASH = "\u2013"
# The forward table's library columns, and forward+backward's.
LIBS = ("cuflash", "naive-cupy", "torch-flash", "torch-cudnn")
BWD_LIBS = ("cuflash", "cuflash-det", "torch-flash", "torch-cudnn")
# The peers of a run with options, and the header of cuflash+opts's ratio to each.
OPTS_RATIO_HEADERS = {"torch-flash": "opts/flash", "torch-cudnn": "opts/cudnn", "jax-cudnn": "opts/jax"}


def cell(result, key="tflops", fmt=".1f", error="ERR") -> str:
    """One figure of a result, or `error` where it raised, or a dash where it did not run."""
    if result is None or key not in result:
        return error if result and "error" in result else DASH
    return format(result[key], fmt)


def ratio(a, b) -> str:
    if a and b and "tflops" in a and "tflops" in b:
        return f"{a['tflops'] / b['tflops']:.2f}"
    return DASH


def _mark(text: str, check: dict) -> str:
    return text + "!" if not check["ok"] and text != "ERR" else text


def table(rows, headers, numeric_from) -> str:
    """Columns from `numeric_from` on right-aligned; tab-separated where tabulate is missing."""
    try:
        from tabulate import tabulate
    except ImportError:
        return "\n".join("\t".join(map(str, r)) for r in [headers, *rows])
    align = ["left"] * numeric_from + ["right"] * (len(headers) - numeric_from)
    return tabulate(rows, headers, disable_numparse=True, colalign=align)


def _shape_cells(r) -> list:
    return [SHORT_DTYPE[r["dtype"]], r["headdim"], "yes" if r["causal"] else "no", seqlen_label(r["seqlen"])]


def _finite_verdict(check: dict, what: str) -> str:
    return f"{what} finite (dropout: no reference)" if check["ok"] else f"NON-FINITE {what}"


def verdict(check: dict) -> str:
    """A forward check as text: ok or MISMATCH, with the error and the reference (or only finite, with dropout)."""
    if "all_finite" in check:
        return _finite_verdict(check, "output")
    return ("ok" if check["ok"] else "MISMATCH") + (
        f" (max err {check['max_abs_err']:.2e} vs {check['reference']})"
        if "max_abs_err" in check else f" ({check.get('error')})")


def speed_table(results) -> str:
    tuned = any("cuflash-tuned" in r["libs"] for r in results)
    headers = ["dtype", "hdim", "causal", "seqlen", "cuflash",
               *(["cuflash-tuned", "tuned/cuflash"] if tuned else []),
               "naive", "torch-flash", "torch-cudnn", "cuflash/flash", "cuflash/cudnn"]
    rows = []
    for r in results:
        libs = r["libs"]
        mine = libs.get("cuflash")
        extra = []
        if tuned:
            extra = [_mark(cell(libs.get("cuflash-tuned")), r.get("check_tuned", {"ok": True})),
                     ratio(libs.get("cuflash-tuned"), mine)]
        rows.append([
            *_shape_cells(r), _mark(cell(mine), r["check"]), *extra,
            # A peer that fails is shown like one that was skipped; the
            # reason is in the log and the JSON.
            *(cell(libs.get(name), error=DASH) for name in LIBS[1:]),
            ratio(mine, libs.get("torch-flash")), ratio(mine, libs.get("torch-cudnn")),
        ])
    return table(rows, headers, 4)


def _grad_verdict(check: dict) -> str:
    if "error" in check:
        return f"ERROR ({check['error']})"
    if "all_finite" in check:
        return _finite_verdict(check, "gradients")
    detail = "" if check["ok"] else ", " + ", ".join(
        f"{g} err {check[g]['max_abs_err']:.1e} tol {check[g]['tol']:.1e}" for g in GRAD_NAMES)
    return (("ok" if check["ok"] else "MISMATCH")
            + f" (max err/tol {check['max_err_over_tol']:.2f}{detail} vs {check['reference']})")


def bwd_verdict(row: dict, names=("cuflash", "cuflash-det")) -> str:
    """A forward+backward row's checks as text: both gradients' (of the libraries `names`) and the
    determinism check's."""
    parts = []
    if "check" in row:
        parts.append(f"{names[0]} " + _grad_verdict(row["check"]))
    if "check_det" in row:
        parts.append(f"{names[1]} " + _grad_verdict(row["check_det"]))
    parts.append(row.get("determinism", "determinism not checked"))
    return "; ".join(parts)


def _det_cell(r, det) -> str:
    """cuflash-det's figure, marked for a mismatch and for results that are not bitwise reproducible."""
    text = _mark(cell(det), r.get("check_det", {"ok": True}))
    if r.get("determinism") not in (None, "det ok") and text != "ERR":
        text += " NONDET"
    return text


def bwd_speed_table(results) -> str:
    headers = ["dtype", "hdim", "causal", "seqlen", *BWD_LIBS, "cuflash/flash", "cuflash/cudnn", "det cost"]
    rows = []
    for r in results:
        libs = r["libs"]
        mine, det = libs.get("cuflash"), libs.get("cuflash-det")
        det_cell = _det_cell(r, det)
        cost = f"{det['ms'] / mine['ms']:.2f}" if mine and det and "ms" in mine and "ms" in det else DASH
        rows.append([
            *_shape_cells(r), _mark(cell(mine), r.get("check", {"ok": True})), det_cell,
            *(cell(libs.get(name), error=DASH) for name in BWD_LIBS[2:]),
            ratio(mine, libs.get("torch-flash")), ratio(mine, libs.get("torch-cudnn")), cost,
        ])
    return table(rows, headers, 4)


def variant_peers(variant) -> tuple[str, ...]:
    """The peer columns of a run with options: torch SDPA's backends with dropout, else JAX's cuDNN attention."""
    return LIBS[2:] if variant.dropout > 0 else ("jax-cudnn",)


def variant_speed_table(results, backward=False, peers=("jax-cudnn",)) -> str:
    """A run with options: cuflash with them (and cuflash-det with --backward) next to plain cuflash and
    `peers`; opts/plain and opts/<peer> are TFLOP/s ratios."""
    headers = ["dtype", "hdim", "causal", "seqlen", "window", "visible", "cuflash", "cuflash+opts",
               *(["cuflash-det+opts"] if backward else []), "opts/plain",
               *(header for peer in peers for header in (peer, OPTS_RATIO_HEADERS[peer]))]
    rows = []
    for r in results:
        libs = r["libs"]
        mine = libs.get("cuflash+opts")
        window = DASH if r["window"] is None else ",".join(map(str, r["window"]))
        rows.append([
            *_shape_cells(r), window, f"{100 * r['visible']:.1f}%", cell(libs.get("cuflash")),
            _mark(cell(mine), r.get("check", {"ok": True})),
            *([_det_cell(r, libs.get("cuflash-det+opts"))] if backward else []),
            ratio(mine, libs.get("cuflash")),
            *(text for peer in peers for text in (cell(libs.get(peer), error=DASH), ratio(mine, libs.get(peer)))),
        ])
    return table(rows, headers, 4)


def memory_table(entries) -> str:
    headers = ["seqlen", "inputs", "cuflash", "naive", "torch-flash", "torch-cudnn"]
    rows = [
        [seqlen_label(e["seqlen"]), f"{e['inputs_mib']:.0f}"]
        + [cell(e["libs"].get(name), "extra_mib", ".0f", error="ERR" if name == "cuflash" else DASH)
           for name in LIBS]
        for e in entries
    ]
    return table(rows, headers, 1)


def bwd_memory_table(entries) -> str:
    headers = ["seqlen", "inputs", "grads", "N x N", *BWD_LIBS]
    rows = [
        [seqlen_label(e["seqlen"]), f"{e['inputs_mib']:.0f}", f"{e['grads_mib']:.0f}", f"{e['scores_mib']:.0f}"]
        + [cell(e["libs"].get(name), "extra_mib", ".0f", error="ERR" if name.startswith("cuflash") else DASH)
           for name in BWD_LIBS]
        for e in entries
    ]
    return table(rows, headers, 1)


def write_json(path, report) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
