"""Two processes on localhost, one global 2×2×2 mesh: the sharded loss equals the one-process run.

Each process is `tests/_multiprocess_worker.py` with 4 CPU devices; they meet
through `jax.distributed.initialize` at a 127.0.0.1 coordinator. The result of
process 0 (loss, metrics, gradients gathered across processes) is compared
with the same computation on this process's 8 devices and with layout=None.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import recloss
from _multiprocess_worker import AXES, MESH_SHAPE, loss_and_grads, make_inputs

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def _run_workers(seed: int, out: Path, n: int = 2):
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([str(WORKER.parents[1]), env.get("PYTHONPATH", "")]))
    port = _free_port()
    logs = [out.with_name(f"worker{i}.log") for i in range(n)]
    procs = []
    try:
        for i in range(n):
            cmd = [sys.executable, str(WORKER), "--process-id", str(i), "--num-processes", str(n),
                   "--port", str(port), "--seed", str(seed), "--out", str(out)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=logs[i].open("w"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * n:
        tails = "\n".join(f"--- worker {i} (exit {c}):\n" + "\n".join(
            logs[i].read_text(errors="replace").splitlines()[-25:]) for i, c in enumerate(codes))
        pytest.fail(f"worker processes failed or timed out after {TIMEOUT_S}s: exit codes {codes}\n{tails}")


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    out = tmp_path / "result.npz"
    _run_workers(seed, out)
    got = np.load(out)

    inputs = make_inputs(seed)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(MESH_SHAPE), AXES)
    (loss, mets), grads = loss_and_grads(inputs, recloss.MeshLayout(mesh))
    (loss0, mets0), grads0 = loss_and_grads(inputs, None)

    for ref_loss, ref_mets, ref_grads in ((loss, mets, grads), (loss0, mets0, grads0)):
        assert _rel(got["loss"], ref_loss) <= 1e-5, (float(got["loss"]), float(ref_loss))
        for k, v in ref_mets.items():
            assert _rel(got[k], v) <= 1e-5, (k, float(got[k]), float(v))
        for name, g in zip(("grad_hidden", "grad_table", "grad_bias"), ref_grads):
            assert got[name].shape == g.shape, (name, got[name].shape, g.shape)
            assert np.max(np.abs(g)) > 0
            assert _rel(got[name], g) <= 1e-4, (name, _rel(got[name], g))
    assert float(got["invalid_targets"]) >= 1.0
