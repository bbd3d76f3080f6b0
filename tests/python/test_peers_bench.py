"""bench/peers.py runs end to end: every contender is checked against
index_select by the operator's index before it is timed (a mismatch exits
non-zero), and each table has every row with its four figures."""

import pathlib
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("moe_reroute._torch")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "peers.py"
ROWS = {
    "overhead": ["torch.index_select", "torch.ops.aten.index_select.default",
                 "torch.ops.moe_reroute.moe_re_routing",
                 "moe_reroute.moe_re_routing (inference_mode)",
                 "torch.ops.moe_reroute.moe_re_routing (requires grad)", "numpy fancy index",
                 "moe_reroute.moe_re_routing (numpy)"],
    "decode": ["torch.index_select (tokens)", "torch.ops.aten.index_select.default",
               "moe_reroute (tokens, scales, weight)",
               "moe_reroute out=", "megatron split+cat", "numpy fancy index (tokens)",
               "moe_reroute (numpy)"],
    "loops": ["torch.index_select (tokens)", "torch.index_select (tokens) out=",
              "moe_reroute.moe_re_routing", "moe_reroute.moe_re_routing out=",
              "torch.ops.moe_reroute.moe_re_routing", "torch.ops.moe_reroute.moe_re_routing_out"],
    "prefill": ["clone (tokens, scales, weight)", "moe_reroute (torch)", "moe_reroute (numpy)",
                "numpy fancy index"],
    "vmap": ["torch.vmap(torch.index_select)", "torch.vmap(moe_reroute.moe_re_routing)",
             "moe_re_routing per entry, stacked", "torch.func.jacrev(torch.index_select)",
             "torch.func.jacrev(moe_reroute.moe_re_routing)"],
}
for _size in ("prefill", "decode"):
    ROWS[f"init_{_size}"] = ["index_select of the same rows",
                             "stable sort of the ids + index_select",
                             "moe_init_routing (torch)", "moe_init_routing (numpy)"]
    ROWS[f"finalize_{_size}"] = ["clone of as many bytes",
                                 "torch index_select, multiply, sum over k",
                                 "moe_finalize_routing (torch)"]
ROWS["cold"] = ROWS["loops"]  # the same contenders, with the caches emptied before each call


def run_peers(*args):
    """bench/peers.py's output with --repeats 1 --allocator default and
    `args`; it must exit 0."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--repeats", "1", "--allocator", "default",
                           *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def assert_rows(out, table):
    """`out` has `table` with every row and its four figures; returns its title."""
    assert f"\n{table}: " in out
    # The table's own lines: from its title to the blank line after it.
    section = out[out.index(f"\n{table}: "):].split("\n\n")[0]
    for name in ROWS[table]:
        row = re.search(rf"^\| {re.escape(name)} +\|(.*)\|$", section, re.MULTILINE)
        assert row, f"{table}: no row {name!r}"
        figures = [float(cell) for cell in row.group(1).split("|")]
        # A time is positive; a ratio to another call's time may print as 0.0
        # where a descheduled call made that time long (a loaded machine).
        assert len(figures) == 4 and figures[0] > 0 and min(figures) >= 0, row.group(0)
    return section.splitlines()[1]


def test_every_table_verifies_and_prints_each_row():
    out = run_peers()
    # The header names the processor, as /proc/cpuinfo does.
    header = re.search(
        r"allocator: torch default \(moe_reroute [^,]+, torch [^,]+, (.+), \d+ CPUs", out)
    assert header and header.group(1).strip(), out[:400]
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    if "model name" in text:
        assert header.group(1) in text
    for table in ROWS:
        assert_rows(out, table)
    idle = out[out.index("after 3 s idle"):]
    assert re.search(r"moe_reroute \(torch\): [0-9.]+ ms, [0-9.]+x its median", idle)


def test_processes_summarize_each_row_across_fresh_processes():
    out = run_peers("--only", "overhead", "--processes", "3")
    assert out.count("\noverhead: ") == 3  # each process printed its own table
    summary = out[out.index("## ratio to each table's baseline in 3 processes"):]
    for name in ROWS["overhead"]:
        row = re.search(rf"^\| default +\| overhead +\| {re.escape(name)} +\| ([0-9. ]+?) +\| +"
                        rf"([0-9.]+) \|$", summary, re.MULTILINE)
        assert row, f"no summary row {name!r}"
        ratios = row.group(1).split()
        assert len(ratios) == 3 and all(float(ratio) > 0 for ratio in ratios)
        assert row.group(2) == sorted(ratios, key=float)[1]  # the middle one, as printed
    assert re.search(r"^\| default +\| overhead +\| torch\.index_select +\| 1\.00 1\.00 1\.00 ",
                     summary, re.MULTILINE), summary


def test_hidden_sets_the_tables_h():
    # --hidden 8: the decode tables at decode's counts, with almost no bytes.
    out = run_peers("--only", "loops", "--hidden", "8")
    assert assert_rows(out, "loops").startswith("loops: A=256 bf16 H=8, ")


def test_before_each_runs_untimed_before_every_timed_call():
    # The cold table's flush: before each timed call, never inside its time.
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import peers
    finally:
        sys.path.remove(str(SCRIPT.parent))
    calls = []

    def flush():
        calls.append("flush")
        time.sleep(0.05)

    times = peers.timings_us({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                             3, before_each=flush)
    timed = calls[-12:]  # 3 rounds of the two contenders, each after a flush
    assert timed[::2] == ["flush"] * 6
    assert sorted(timed[1::2]) == ["a"] * 3 + ["b"] * 3
    assert "flush" not in calls[:-12]  # not before the first and warm-up calls
    assert all(median < 0.025e6 for median, _, _ in times.values()), times
