"""`shardwise.communication.init()` without `shardwise run`: processes started the way mpirun
(Open MPI variables + MASTER_ADDR/MASTER_PORT) or a MindSpore rank table would start them, each
checking its rank and group size and all-reducing; and a plain single process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.testing import clean_env, free_port

WORKER = Path(__file__).with_name("workers") / "env_init.py"

pytestmark = pytest.mark.multiprocess


def run_ranks(envs: list[dict[str, str]], cwd: Path) -> list[dict[str, float]]:
    """Start one worker per environment, wait for all, return each one's RESULT line."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER)],
            env={**clean_env(), **env},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for env in envs
    ]
    try:
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out
        results.append(json.loads(out.split("RESULT ")[1].splitlines()[0]))
    return results


@pytest.mark.timeout(90)
def test_mpirun_style_environment(tmp_path: Path) -> None:
    port = str(free_port())
    envs = [
        {
            "OMPI_COMM_WORLD_RANK": str(r),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        for r in range(2)
    ]
    results = run_ranks(envs, tmp_path)
    assert [(x["rank"], x["size"], x["local"]) for x in results] == [(0, 2, 0), (1, 2, 1)]
    assert [x["sum"] for x in results] == [3.0, 3.0]


@pytest.mark.timeout(90)
def test_rank_table_environment(tmp_path: Path) -> None:
    table = {
        "version": "1.0",
        "server_count": "1",
        "server_list": [
            {
                "server_id": "127.0.0.1",
                "device": [
                    {"device_id": str(r), "device_ip": "0.0.0.0", "rank_id": str(r)}
                    for r in range(2)
                ],
                "host_nic_ip": "reserve",
            }
        ],
        "status": "completed",
    }
    path = tmp_path / "rank_table_2pcs.json"
    path.write_text(json.dumps(table))
    port = str(free_port())
    envs = [
        {"RANK_TABLE_FILE": str(path), "RANK_ID": str(r), "RANK_SIZE": "2", "MASTER_PORT": port}
        for r in range(2)
    ]
    results = run_ranks(envs, tmp_path)
    assert [(x["rank"], x["size"], x["local"]) for x in results] == [(0, 2, 0), (1, 2, 1)]
    assert [x["sum"] for x in results] == [3.0, 3.0]


@pytest.mark.timeout(60)
def test_plain_single_process(tmp_path: Path) -> None:
    [result] = run_ranks([{}], tmp_path)
    assert (result["rank"], result["size"], result["local"], result["sum"]) == (0, 1, 0, 1.0)
