"""Real Open MPI: ``mpirun -np 4`` starts 4 ranks of a script that joins with
`shardwise.communication.init()` (which reads ``OMPI_COMM_WORLD_*``) and checks every
collective, forward and gradient, against single-process math (real_collectives_worker.py).

``make test`` installs Open MPI (``openmpi-bin``) when ``mpirun`` is missing; elsewhere the
test is skipped with the reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.testing import clean_env, free_port

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from test_collectives_real import CHECKS  # noqa: E402

MPIRUN = shutil.which("mpirun")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not on PATH: install Open MPI (openmpi-bin)")
def test_mpirun_four_ranks_check_every_collective(tmp_path: Path) -> None:
    assert MPIRUN is not None
    env = {
        **clean_env(),
        "MASTER_PORT": str(free_port()),  # the store rank 0 hosts (127.0.0.1: one node)
        "OMPI_ALLOW_RUN_AS_ROOT": "1",  # Open MPI refuses root otherwise (CI runs as root)
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",  # 4 ranks on fewer cores
    }
    cmd = [
        MPIRUN, "-np", "4", "--output-filename", str(tmp_path / "out"),
        sys.executable, str(HERE / "real_collectives_worker.py"),
    ]  # fmt: skip
    started = time.monotonic()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    print(f"mpirun job: {time.monotonic() - started:.1f} s")
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in range(4):  # Open MPI 4 writes OUT/1/rank.<r>/stdout
        (path,) = (tmp_path / "out").glob(f"*/rank.{rank}/stdout")
        mine = path.read_text()
        for name in CHECKS:
            assert f"CHECK {name} OK\n" in mine, f"rank {rank} did not pass {name}:\n{mine}"
