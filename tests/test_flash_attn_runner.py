"""tools/flash_attn_tests.py on a small stand-in test file (no GPU): cases chosen by head dim, and a
run cut short by --budget still reports what it did."""

import subprocess
import sys
import time
from pathlib import Path

RUNNER = Path(__file__).resolve().parent.parent / "tools" / "flash_attn_tests.py"

STAND_IN = '''
import time

import pytest


@pytest.mark.parametrize("d", [64, 32])
def test_quick(d):
    assert d == 64


def test_slow():
    time.sleep(120)
'''


def test_budget_interrupts_and_summarises(tmp_path):
    test_file = tmp_path / "test_stand_in.py"
    test_file.write_text(STAND_IN)
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(RUNNER), str(test_file), "--headdims", "64", "--budget", "8"],
                          capture_output=True, text=True, timeout=100)
    elapsed = time.monotonic() - start
    output = done.stdout + done.stderr
    assert elapsed < 60, output
    assert "8 s spent: interrupting pytest" in output
    assert "1 passed" in output and "failed" not in output, output
    assert "flash_attn_tests: 2 cases chosen" in output
    assert "left out 1: head dim not chosen" in output
