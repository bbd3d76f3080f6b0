"""bench/ep.py runs end to end at tiny sizes: each case checks ep against the
baseline before timing (a mismatch exits non-zero), each process prints every
case's table, and --processes prints the medians of their medians."""

import pathlib
import re
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "ep.py"
STEPS = ("dispatch", "combine", "both")


def rows(section):
    """step -> the six figures of its row in `section`, each checked positive."""
    figures = {}
    for step in STEPS:
        row = re.search(rf"^\| {step} +\|(.*)\|$", section, re.MULTILINE)
        assert row, f"no row {step!r} in\n{section}"
        figures[step] = [float(cell) for cell in row.group(1).split("|")]
        assert len(figures[step]) == 6 and all(f > 0 for f in figures[step]), row.group(0)
    return figures


def test_two_processes_verify_and_print_each_case_and_their_medians():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--processes", "2", "--repeats", "1",
                           "--tokens", "8", "--hidden", "16"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for case, dtype in (("prefill", "int8 H = 16 with float32 scales"), ("decode", "bfloat16 H = 16")):
        # Each process's own table, then the summary's.
        assert out.count(f"\n{case}: 2 ranks, T = 8 tokens each, top-8 of 256 experts, {dtype}") == 2
        summary = out[out.index(f"\n{case}: the medians of 2 processes' medians (ms)"):]
        figures = rows(summary.split("\n\n")[0])
        # The ratios are the medians' own: ep / baseline, ep / limit, baseline / limit.
        for ep, base, limit, *ratios in figures.values():
            assert ratios == pytest.approx([ep / base, ep / limit, base / limit], rel=0.02, abs=0.01)
        for step in STEPS:
            each = re.search(rf"^{step} ep/baseline in each process: ([0-9.]+) ([0-9.]+); "
                             r"their median ([0-9.]+)$", summary, re.MULTILINE)
            assert each, f"no line of {step}'s ratios in\n{summary}"
            first, second, median = map(float, each.groups())
            assert median == pytest.approx((first + second) / 2, abs=0.01)
    assert "checking ep against the baseline" in proc.stderr
