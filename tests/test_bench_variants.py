"""The benchmark's attention options (--window, --softcap, --alibi, --dropout): their parsing, the visible-entry
FLOP count, the rows' FLOPs, peers and table; on a GPU, the naive CuPy reference with the options against float64
NumPy."""

import itertools
import math

import numpy as np
import pytest

from cuflash.bench import cli, tables
from cuflash.bench.shapes import Shape, flops_by_library, variant_fields
from cuflash.bench.variants import DROPOUT_OFFSET, DROPOUT_SEED, NO_WINDOW, Variant, parse_window, visible_entries
from cuflash.score_mods import standard_alibi_slopes as alibi_slopes


def brute_force_mask(nq, nk, causal, window):
    """flash-attn's mask, entry by entry: query i sees key j iff j is inside i's window."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(nq)[:, None] + nk - nq
    j = np.arange(nk)[None, :]
    return ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right))


@pytest.mark.parametrize("text, window", [
    ("4096", (4096, 4096)), ("4096,0", (4096, 0)), (" 128 , 64 ", (128, 64)), ("-1,0", (-1, 0)), ("0", (0, 0)),
])
def test_window_spellings(text, window):
    assert parse_window(text) == window


@pytest.mark.parametrize("text", ["-1,-1", "-2,0", "1,2,3", "x", ""])
def test_bad_windows_are_refused(text):
    with pytest.raises(ValueError):
        parse_window(text)


def test_no_switch_leaves_the_run_without_options():
    args = cli.parse_args([])
    assert args.variant == Variant() and not args.variant.enabled
    assert args.variant.kwargs(16, True) == {}


def test_switches_make_the_variant():
    args = cli.parse_args(["--window", "256", "--softcap", "30", "--alibi", "--backward"])
    assert args.variant == Variant((256, 256), 30.0, True)
    assert args.variant.describe() == "window (256, 256), softcap 30, alibi"
    causal = args.variant.kwargs(4, causal=True)
    assert causal["window_size"] == (256, 0) and causal["softcap"] == 30.0
    assert causal["alibi_slopes"].dtype == np.float32 and causal["alibi_slopes"].shape == (4,)
    assert args.variant.kwargs(4, causal=False)["window_size"] == (256, 256)
    assert cli.parse_args(["--window=-1,8"]).variant.window == (-1, 8)
    assert cli.parse_args(["--softcap", "50"]).variant.kwargs(2, False) == {"softcap": 50.0}


@pytest.mark.parametrize("argv", [
    ["--window", "0,-2"], ["--window", "-1,-1"], ["--softcap", "-1"], ["--softcap", "nan"],
    ["--alibi", "--fp8"], ["--window", "64", "--tuned"], ["--ring", "--nccl-channels", "0"], ["--graphs"],
])
def test_bad_switches_are_usage_errors(argv):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)


def test_graphs_switch_goes_with_decode():
    assert cli.parse_args(["--decode", "--graphs"]).graphs and not cli.parse_args(["--decode"]).graphs


def test_dropout_switch_makes_the_variant():
    args = cli.parse_args(["--dropout", "0.1", "--backward", "--causal", "--headdim", "64,128", "--seqlen", "8k",
                           "--dtype", "fp16", "--quick", "--json", "out.json"])
    assert args.variant == Variant(dropout=0.1)
    assert args.variant.enabled and not args.variant.has_score_options
    assert args.variant.describe() == "dropout 0.1"
    assert args.variant.kwargs(4, causal=True) == {"dropout_p": 0.1, "seed": DROPOUT_SEED, "offset": DROPOUT_OFFSET}
    assert (args.backward, args.masks, args.headdims, args.seqlens, args.dtypes) == (
        True, [True], [64, 128], [8192], ["float16"])
    assert args.variant.to_json()["dropout"] == 0.1


def test_dropout_combines_with_the_score_options():
    variant = cli.parse_args(["--dropout", "0.25", "--window", "128,0", "--alibi", "--no-causal"]).variant
    assert variant == Variant((128, 0), 0.0, True, 0.25)
    assert variant.describe() == "window (128, 0), alibi, dropout 0.25"
    kwargs = variant.kwargs(2, causal=False)
    assert kwargs["window_size"] == (128, 0) and kwargs["dropout_p"] == 0.25 and kwargs["seed"] == DROPOUT_SEED
    assert "dropout" not in variant.reference_kwargs(2, 2)


@pytest.mark.parametrize("value", ["0", "1", "-0.1", "1.5", "nan", "inf", "x"])
def test_bad_dropout_is_a_usage_error_naming_the_switch(capsys, value):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args([f"--dropout={value}"])
    assert exc.value.code == 2
    assert "--dropout" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["--fp8", "--tuned", "--varlen", "--decode", "--ring"])
def test_dropout_refuses_the_other_modes(capsys, mode):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--dropout", "0.1", mode])
    assert exc.value.code == 2
    assert f"--dropout does not combine with {mode}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, torch_loaded, jax_loaded", [
    (["--dropout", "0.1"], True, False),
    (["--dropout", "0.1", "--backward"], True, False),
    (["--dropout", "0.1", "--window", "64"], False, False),
    (["--dropout", "0.1", "--no-peers"], False, False),
    (["--window", "64"], False, True),
    (["--softcap", "30"], False, False),
])
def test_each_run_with_options_loads_the_peers_that_take_them(monkeypatch, argv, torch_loaded, jax_loaded):
    from cuflash.bench import run

    loaded = []

    def load_torch_libs(log, backward, dropout_p):
        loaded.append(("torch", backward, dropout_p))
        return ["torch-flash", "torch-cudnn"]

    def load_jax_libs(log, variant, backward):
        loaded.append(("jax", backward))
        return ["jax-cudnn"]

    monkeypatch.setattr(run, "load_torch_libs", load_torch_libs)
    monkeypatch.setattr(run, "load_jax_libs", load_jax_libs)
    args = cli.parse_args(argv)
    mine, timed, torch_libs = run._variant_libraries(args)
    assert [lib.name for lib in mine] == (["cuflash+opts", "cuflash-det+opts", "cuflash"] if args.backward
                                          else ["cuflash+opts", "cuflash"])
    assert all(lib.variant == args.variant for lib in mine[:-1]) and mine[-1].variant == Variant()
    expected = ([("torch", args.backward, 0.1)] if torch_loaded else []) + (
        [("jax", args.backward)] if jax_loaded else [])
    assert loaded == expected
    assert torch_libs == (["torch-flash", "torch-cudnn"] if torch_loaded else [])
    assert timed[len(mine):] == torch_libs + (["jax-cudnn"] if jax_loaded else [])


def test_alibi_slopes_are_the_standard_geometric_series():
    np.testing.assert_array_equal(alibi_slopes(8), [2.0 ** -(h + 1) for h in range(8)])
    assert alibi_slopes(16)[0] == 2.0 ** -0.5 and alibi_slopes(16)[-1] == 2.0 ** -8


@pytest.mark.parametrize("nq, nk", [(1, 1), (5, 5), (7, 3), (3, 9), (16, 16)])
def test_visible_entries_match_the_mask(nq, nk):
    for causal, left, right in itertools.product((False, True), (-1, 0, 1, 2, 5, 20), (-1, 0, 1, 3, 20)):
        expected = int(brute_force_mask(nq, nk, causal, (left, right)).sum())
        assert visible_entries(nq, nk, causal, (left, right)) == expected, (causal, left, right)


def test_visible_entries_of_the_plain_masks():
    n = 1000
    assert visible_entries(n, n, False) == visible_entries(n, n, False, (n, n)) == n * n
    assert visible_entries(n, n, True) == visible_entries(n, n, True, (n, n)) == n * (n + 1) // 2
    assert visible_entries(n, n, False, (n, 0)) == visible_entries(n, n, True)
    assert visible_entries(n, n, False, (0, 0)) == n
    # A left window W: the first W rows see i + 1 keys, the others W + 1.
    assert visible_entries(n, n, True, (99, 0)) == 100 * 101 // 2 + 900 * 100


def test_variant_flops():
    full, causal = Shape("float16", 128, False, 4096), Shape("float16", 128, True, 4096)
    assert full.variant_flops(Variant()) == full.flops
    assert full.variant_flops(Variant(softcap=30.0, alibi=True)) == full.flops
    assert full.variant_flops(Variant((4096, 4096))) == full.flops
    assert causal.variant_flops(Variant(alibi=True)) == causal.flops  # the papers' N^2 / 2
    assert full.variant_flops(Variant(dropout=0.1)) == full.flops  # dropout masks no visible entry
    assert causal.variant_flops(Variant(dropout=0.1)) == causal.flops
    # The exact causal count, N (N + 1) / 2, is within 1 / N of the papers' N^2 / 2.
    exact = causal.variant_flops(Variant((-1, 0)))
    assert exact == causal.flops * (1 + 1 / 4096)
    per_pair = 4.0 * causal.batch * causal.heads * causal.headdim
    assert causal.variant_flops(Variant((1023, 1023))) == per_pair * (1024 * 1025 // 2 + 3072 * 1024)


def test_rows_count_each_library_under_its_options():
    class Lib:
        def __init__(self, name, variant):
            self.name, self.variant = name, variant

    shape = Shape("bfloat16", 64, True, 2048)
    window = Variant((511, 0))
    libs = [Lib("cuflash+opts", window), Lib("cuflash", Variant()), Lib("jax-cudnn", window)]
    flops = flops_by_library(shape, libs, 3.5)
    assert flops["cuflash"] == shape.bwd_flops
    assert flops["cuflash+opts"] == flops["jax-cudnn"] == 3.5 * shape.variant_flops(window)
    assert variant_fields(shape, Variant()) == {}
    fields = variant_fields(shape, Variant((511, 511), softcap=30.0))
    assert fields["window"] == [511, 0]
    assert fields["visible"] == pytest.approx((512 * 513 / 2 + 1536 * 512) / 2048 ** 2)
    assert fields["opts_flops"] == shape.variant_flops(window)
    assert variant_fields(shape, Variant(alibi=True))["window"] is None


def test_time_libraries_takes_each_library_s_flops(monkeypatch):
    from cuflash import timing
    from cuflash.bench.measure import time_libraries

    monkeypatch.setattr(timing, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "time_calls", lambda entries, *a: {name: {"ms": 2.0} for name in entries})

    class Lib:
        events = None

        def __init__(self, name):
            self.name = name

        def prepare(self, *inputs):
            return lambda: None

        @staticmethod
        def context():
            return None

    results = time_libraries([Lib("a"), Lib("b")], False, [()], 3, 4e12, lib_flops={"b": 1e12})
    assert results["a"]["tflops"] == pytest.approx(2000.0) and results["b"]["tflops"] == pytest.approx(500.0)


def test_variant_table():
    row = {"dtype": "bfloat16", "headdim": 128, "causal": True, "seqlen": 16384, "window": [4095, 0],
           "visible": 0.2344, "check": {"ok": True}, "check_det": {"ok": False}, "determinism": "det ok",
           "libs": {"cuflash": {"tflops": 600.0}, "cuflash+opts": {"tflops": 450.0},
                    "cuflash-det+opts": {"tflops": 400.0}, "jax-cudnn": {"tflops": 300.0}}}
    line = tables.variant_speed_table([row]).splitlines()[-1].split()
    assert line == ["bf16", "128", "yes", "16k", "4095,0", "23.4%", "600.0", "450.0", "0.75", "300.0", "1.50"]
    line = tables.variant_speed_table([row], backward=True).splitlines()[-1].split()
    assert line[6:9] == ["600.0", "450.0", "400.0!"]
    softcap = {**row, "window": None, "visible": 0.5, "libs": {"cuflash": {"tflops": 600.0},
                                                               "cuflash+opts": {"error": "x"}}}
    line = tables.variant_speed_table([softcap]).splitlines()[-1].split()
    assert line[4:] == [tables.DASH, "50.0%", "600.0", "ERR", tables.DASH, tables.DASH, tables.DASH]


def test_dropout_table_shows_the_torch_peers():
    row = {"dtype": "float16", "headdim": 64, "causal": False, "seqlen": 8192, "window": None, "visible": 1.0,
           "check": {"ok": True, "reference": None, "all_finite": True},
           "libs": {"cuflash": {"tflops": 500.0}, "cuflash+opts": {"tflops": 400.0},
                    "torch-flash": {"tflops": 250.0}, "torch-cudnn": {"skipped": "No available kernel"}}}
    peers = tables.variant_peers(Variant(dropout=0.1))
    assert peers == ("torch-flash", "torch-cudnn")
    assert tables.variant_peers(Variant((64, 0))) == ("jax-cudnn",)
    header, _, line = tables.variant_speed_table([row], peers=peers).splitlines()
    assert header.split()[-5:] == ["opts/plain", "torch-flash", "opts/flash", "torch-cudnn", "opts/cudnn"]
    assert line.split()[6:] == ["500.0", "400.0", "0.80", "250.0", "1.60", tables.DASH, tables.DASH]
    nonfinite = {**row, "check": {"ok": False, "reference": None, "all_finite": False}}
    assert tables.variant_speed_table([nonfinite], peers=peers).splitlines()[-1].split()[7] == "400.0!"


def test_dropout_checks_read_as_finite_or_not():
    finite, nonfinite = ({"ok": ok, "reference": None, "all_finite": ok} for ok in (True, False))
    assert tables.verdict(finite) == "output finite (dropout: no reference)"
    assert tables.verdict(nonfinite) == "NON-FINITE output"
    row = {"check": finite, "check_det": nonfinite, "determinism": "det ok"}
    assert tables.bwd_verdict(row, ["cuflash+opts", "cuflash-det+opts"]) == (
        "cuflash+opts gradients finite (dropout: no reference); cuflash-det+opts NON-FINITE gradients; det ok")


@pytest.mark.gpu
def test_dropout_rows_run_cuflash_with_dropout_and_check_finite_results():
    import cupy

    from cuflash.bench.fwd import check_shape
    from cuflash.bench.fwd_bwd import check_shape_bwd
    from cuflash.bench.inputs import random_dout, random_qkv
    from cuflash.bench.libs import Cuflash, CuflashFwdBwd

    shape, dims, dropout = Shape("float16", 64, True, 256), (2, 256, 4, 64), Variant(dropout=0.1)
    qkv = random_qkv(*dims, np.float16, 0)
    plain, dropped, again = (lib.prepare(*qkv, True)() for lib in (Cuflash(), Cuflash(variant=dropout),
                                                                   Cuflash(variant=dropout)))
    assert not cupy.array_equal(plain, dropped) and cupy.array_equal(dropped, again)  # one fixed mask
    assert check_shape(shape, qkv, Cuflash(variant=dropout), None) == {
        "ok": True, "reference": None, "all_finite": True}
    inputs = (*qkv, random_dout(*dims, np.float16, 0))
    result = check_shape_bwd(shape, inputs, CuflashFwdBwd(False, dropout), CuflashFwdBwd(True, dropout), None)
    assert result["determinism"] == "det ok"
    assert result["check"]["all_finite"] and result["check_det"]["all_finite"]


def reference_attention(q, k, v, causal, window, softcap, slopes):
    """float64 NumPy attention for (N, H, D) inputs, flash-attn's options, entry by entry."""
    nq, nk, d = q.shape[0], k.shape[0], q.shape[2]
    s = np.einsum("ihd,jhd->hij", q, k) / math.sqrt(d)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if slopes is not None:
        distance = np.abs(np.arange(nq)[:, None] + nk - nq - np.arange(nk)[None, :])
        s = s - slopes[:, None, None] * distance
    s = np.where(brute_force_mask(nq, nk, causal, window), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p, v)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window, softcap, alibi", [
    (False, NO_WINDOW, 0.0, False), (True, NO_WINDOW, 0.0, False), (False, (7, 3), 0.0, False),
    (True, (5, 5), 0.0, False), (False, (-1, 4), 2.0, False), (False, NO_WINDOW, 0.0, True),
    (True, (9, 0), 1.5, True),
])
def test_naive_reference_takes_the_options(rng, causal, window, softcap, alibi):
    import cupy

    from cuflash.bench.naive import naive_attention, naive_attention_backward

    heads = 3
    q, k, v, dout = (rng.standard_normal((1, 40, heads, 16)) for _ in range(4))
    slopes = alibi_slopes(heads).astype(np.float64) if alibi else None
    kwargs = Variant(window, softcap, alibi).reference_kwargs(heads, heads)
    out = naive_attention(*(cupy.asarray(x, cupy.float32) for x in (q, k, v)), causal, **kwargs)
    ref = reference_attention(q[0], k[0], v[0], causal, window, softcap, slopes)
    np.testing.assert_allclose(cupy.asnumpy(out)[0], ref, atol=2e-5)

    # The backward against finite differences of the float64 reference's <out, dout>.
    grads = naive_attention_backward(*(cupy.asarray(x, cupy.float32) for x in (dout, q, k, v)), causal, **kwargs)
    def loss(qkv):
        return float((reference_attention(*(x[0] for x in qkv), causal, window, softcap, slopes) * dout[0]).sum())
    for which, grad in enumerate(grads):
        index = (0, 11, 1, 5)
        eps = 1e-6
        plus, minus = [x.copy() for x in (q, k, v)], [x.copy() for x in (q, k, v)]
        plus[which][index] += eps
        minus[which][index] -= eps
        numeric = (loss(plus) - loss(minus)) / (2 * eps)
        assert float(grad[index]) == pytest.approx(numeric, rel=1e-3, abs=1e-4)
