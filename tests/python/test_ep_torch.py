"""Runs examples/ep_torch.py, the expert-parallel layer on torch.distributed
(gloo), on several processes and checks that rank 0 verified it."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("moe_reroute")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ep_torch.py"
STAGES = {"moe_init_routing", "exchange_counts", "dispatch_alltoallv", "moe_re_routing", "experts",
          "moe_re_routing_inverse", "return_alltoallv", "moe_finalize_routing", "total"}


def run_example(*flags):
    return subprocess.run([sys.executable, str(EXAMPLE), "--repeat", "3", *flags],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_layer_verifies(num_ranks):
    proc = run_example("--ranks", str(num_ranks))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ranks"] == num_ranks
    assert result["verified"] is True
    assert result["tokens_per_rank"] == 256
    assert set(result["times_ms"]) == STAGES
    # The total is the layer's time (a median, as each stage's), not the time
    # since some other clock's origin.
    times = result["times_ms"]
    assert max(times.values()) == times["total"] < 60_000


def test_layer_verifies_with_odd_widths_and_top1():
    proc = run_example("--ranks", "3", "--tokens-per-rank", "37", "--hidden", "5", "--out-hidden", "11",
                       "--experts-per-rank", "3", "--topk", "1", "--seed", "7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["ranks"], result["verified"], result["tokens_per_rank"]) == (3, True, 37)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_layer_verifies_with_a_fixed_capacity_and_aligned_segments(num_ranks):
    proc = run_example("--ranks", str(num_ranks), "--tokens-per-rank", "64", "--fixed-capacity",
                       "--expert-alignment", "128")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["ranks"], result["verified"]) == (num_ranks, True)


def test_topk_past_the_experts_is_an_error():
    spec = importlib.util.spec_from_file_location("ep_torch", EXAMPLE)
    ep_torch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ep_torch)
    with pytest.raises(SystemExit, match="--topk: 5 exceeds the 4 experts of 2 ranks"):
        ep_torch.main(["--ranks", "2", "--experts-per-rank", "2", "--topk", "5"])
