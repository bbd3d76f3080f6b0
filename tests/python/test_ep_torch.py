"""Runs examples/ep_torch.py, the expert-parallel layer on torch.distributed
(gloo), on several processes, with moe_reroute.ep (the default) and with
--baseline (the steps it replaces), and checks that rank 0 verified it."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("moe_reroute")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ep_torch.py"
STAGES = {
    "ep": {"dispatch", "experts", "combine", "total"},
    "baseline": {"moe_init_routing", "exchange_counts", "dispatch_alltoallv", "moe_re_routing",
                 "experts", "moe_re_routing_inverse", "return_alltoallv", "moe_finalize_routing",
                 "total"},
}
MODE_FLAGS = {"ep": (), "baseline": ("--baseline",)}


def run_example(mode, *flags):
    """The example's last line (JSON) in `mode`; it must exit 0 and name the mode."""
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--repeat", "3", *MODE_FLAGS[mode], *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mode"] == mode
    # The per-stage table has this mode's stages, in the JSON line's order.
    table = proc.stdout[proc.stdout.index(f"{mode}: stage (max over ranks)"):].splitlines()[1:-1]
    assert [line.split()[0] for line in table] == list(result["times_ms"])
    return result


@pytest.mark.parametrize("mode, num_ranks", [("ep", 2), ("ep", 4), ("baseline", 2)])
def test_layer_verifies(mode, num_ranks):
    result = run_example(mode, "--ranks", str(num_ranks))
    assert result["ranks"] == num_ranks
    assert result["verified"] is True
    assert result["tokens_per_rank"] == 256
    assert set(result["times_ms"]) == STAGES[mode]
    # The total is the layer's time (a median, as each stage's), not the time
    # since some other clock's origin.
    times = result["times_ms"]
    assert max(times.values()) == times["total"] < 60_000


@pytest.mark.parametrize("mode", ["ep", "baseline"])
def test_layer_verifies_with_odd_widths_and_top1(mode):
    result = run_example(mode, "--ranks", "3", "--tokens-per-rank", "37", "--hidden", "5",
                         "--out-hidden", "11", "--experts-per-rank", "3", "--topk", "1",
                         "--seed", "7")
    assert (result["ranks"], result["verified"], result["tokens_per_rank"]) == (3, True, 37)


@pytest.mark.parametrize("mode, num_ranks", [("ep", 4), ("baseline", 2)])
def test_layer_verifies_with_a_fixed_capacity_and_aligned_segments(mode, num_ranks):
    result = run_example(mode, "--ranks", str(num_ranks), "--tokens-per-rank", "64",
                         "--fixed-capacity", "--expert-alignment", "128")
    assert (result["ranks"], result["verified"]) == (num_ranks, True)


def test_a_rank_without_tokens_verifies():
    # T = 0 on every rank: ep sends and receives nothing, and the layer is empty.
    result = run_example("ep", "--ranks", "2", "--tokens-per-rank", "0", "--fixed-capacity")
    assert (result["ranks"], result["verified"], result["tokens_per_rank"]) == (2, True, 0)


def test_topk_past_the_experts_is_an_error():
    spec = importlib.util.spec_from_file_location("ep_torch", EXAMPLE)
    ep_torch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ep_torch)
    with pytest.raises(SystemExit, match="--topk: 5 exceeds the 4 experts of 2 ranks"):
        ep_torch.main(["--ranks", "2", "--experts-per-rank", "2", "--topk", "5"])
