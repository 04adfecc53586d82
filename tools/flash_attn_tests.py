"""Run flash-attn's own test file against cuflash's kernels, through the stand-in `flash_attn`
package in tools/flash_attn_compat (cuflash.torch's functions under flash-attn's names).

    python tools/flash_attn_tests.py --fetch                    # test_flash_attn.py, the pinned file
    python tools/flash_attn_tests.py test_flash_attn.py --headdims 64,128 --fraction 0.1 -- -x
    python tools/flash_attn_tests.py test_flash_attn.py --budget 300 -- -n 6   # stops at 300 s, summarised

Needs a CUDA GPU, torch and einops. Cases are chosen by head dim, dtype and a seeded fraction
(fa_select.py); what is left out, and why, is printed at the end. docs/flash_attn_tests.md lists
where cuflash differs from flash-attn on purpose, and the runs so far.
"""
import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import urllib.request

# flash-attn's FlashAttention-2 tests at the commit they were last read against.
PINNED_COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"
PINNED_URL = f"https://raw.githubusercontent.com/Dao-AILab/flash-attention/{PINNED_COMMIT}/tests/test_flash_attn.py"
HERE = pathlib.Path(__file__).resolve().parent
INTERRUPT_GRACE = 60  # seconds pytest (and its xdist workers) may take to stop and summarise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", nargs="?", default="test_flash_attn.py")
    parser.add_argument("--fetch", action="store_true", help=f"download the test file of {PINNED_COMMIT[:10]}")
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--fraction", type=float, default=1.0, help="seeded share of the chosen cases to run")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds after which pytest is interrupted, so that a run cut short by a time "
                             "limit still prints what passed and failed")
    args, pytest_args = parser.parse_known_args(argv)
    test_file = pathlib.Path(args.test_file)
    if args.fetch:
        urllib.request.urlretrieve(PINNED_URL, test_file)
        print(f"wrote {test_file}")
        return 0
    if not test_file.is_file():
        parser.error(f"test_file: no file {test_file} (--fetch downloads it)")
    env = dict(os.environ, CUFLASH_FA_HEADDIMS=args.headdims, CUFLASH_FA_DTYPES=args.dtypes,
               CUFLASH_FA_FRACTION=str(args.fraction))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "flash_attn_compat"), str(HERE.parent),
                                                      env.get("PYTHONPATH")]))
    extra = pytest_args[1:] if pytest_args[:1] == ["--"] else pytest_args
    command = [sys.executable, "-m", "pytest", "-p", "fa_select", "-p", "no:cacheprovider", "-q",
               str(test_file.resolve()), *extra]
    with tempfile.TemporaryDirectory() as scratch:
        summary = pathlib.Path(scratch) / "selection.json"
        env["CUFLASH_FA_SUMMARY"] = str(summary)
        status = run_within(command, env, scratch, args.budget)
        if summary.is_file():
            chosen = json.loads(summary.read_text())
            print(f"flash_attn_tests: {chosen['chosen']} cases chosen", flush=True)
            for reason, count in sorted(chosen["left out"].items()):
                print(f"flash_attn_tests: left out {count}: {reason}")
    return status


def run_within(command, env, cwd, budget) -> int:
    """Run pytest; past `budget` seconds, interrupt it as Ctrl-C would (its summary then counts the
    cases done), and kill it if it has not stopped INTERRUPT_GRACE seconds later."""
    process = subprocess.Popen(command, env=env, cwd=cwd)
    try:
        return process.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        print(f"flash_attn_tests: {budget:g} s spent: interrupting pytest", flush=True)
        process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout=INTERRUPT_GRACE)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


if __name__ == "__main__":
    sys.exit(main())
