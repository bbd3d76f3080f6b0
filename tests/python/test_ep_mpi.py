"""moe_reroute.ep over mpi4py: ep_mpi_worker.py under mpirun at 2, 3 and 4
ranks (one launch each: every case and refusal, byte for byte against the
naive reference), and the package without mpi4py or without the _ep module.
A hang fails by the subprocess timeout."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import moe_reroute

HERE = pathlib.Path(__file__).resolve().parent
MPIRUN = shutil.which("mpirun")
HAS_MPI4PY = importlib.util.find_spec("mpi4py") is not None
HAS_EP = importlib.util.find_spec("moe_reroute._ep") is not None
TIMEOUT_S = 300  # one launch takes seconds; past this, a rank hangs


def python_path() -> str:
    """This session's moe_reroute and the test helpers, for the child processes."""
    package_root = pathlib.Path(moe_reroute.__file__).resolve().parent.parent
    return os.pathsep.join([str(package_root), str(HERE), os.environ.get("PYTHONPATH", "")])


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH")
@pytest.mark.skipif(not HAS_MPI4PY, reason="mpi4py is not installed")
@pytest.mark.skipif(not HAS_EP, reason="moe_reroute was built without MPI (no moe_reroute._ep)")
@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_dispatch_and_combine_over_mpi(num_ranks):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=python_path())
    command = [MPIRUN, "--oversubscribe", "--allow-run-as-root", "--mca", "btl", "self,vader",
               "--mca", "btl_vader_single_copy_mechanism", "none", "-x", "PYTHONPATH",
               "-x", "OMP_NUM_THREADS", "-n", str(num_ranks), sys.executable,
               str(HERE / "ep_mpi_worker.py")]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # SIGTERM: mpirun ends its ranks on it, which a SIGKILL would orphan.
            process.terminate()
            stdout, stderr = process.communicate(timeout=60)
            pytest.fail(f"mpirun -n {num_ranks} hung for {TIMEOUT_S} s:\n"
                        f"{stdout[-4000:]}{stderr[-4000:]}")
    lines = stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL ")]
    assert not failed and process.returncode == 0, "\n".join(
        failed or [stdout[-4000:], stderr[-4000:]])
    passed = [line for line in lines if line.startswith("ok ")]
    assert len(passed) >= 60  # the worker's sweep and refusals all reported
    assert lines[-1] == f"passed {len(passed)} cases on {num_ranks} ranks"


def test_package_imports_and_works_without_mpi4py():
    """None in sys.modules makes `import mpi4py` fail, as where it is not installed."""
    code = ("import sys; sys.modules['mpi4py'] = None\n"
            "import numpy as np, moe_reroute\n"
            "out = moe_reroute.moe_re_routing(np.arange(6, dtype=np.float32).reshape(3, 2),\n"
            "                                 np.array([[2, 1]], np.int32))\n"
            "assert out[0].tolist() == [[0, 1], [2, 3], [4, 5]], out\n"
            "assert callable(moe_reroute.ep.dispatch) and 'mpi4py.MPI' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, PYTHONPATH=python_path()))
    assert result.returncode == 0, result.stderr


def test_dispatch_without_the_ep_module(monkeypatch):
    """A build without MPI (no moe_reroute._ep) says so when an mpi4py
    communicator asks for it."""
    from moe_reroute import _ep_mpi

    monkeypatch.setitem(sys.modules, "moe_reroute._ep", None)
    with pytest.raises(RuntimeError, match="no MPI support"):
        _ep_mpi.dispatch(np.zeros((1, 2), np.float32), np.zeros((1, 1), np.int32), 1, None,
                         None, None, None, 1, None, 0, 1)
