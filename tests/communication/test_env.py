"""detect_job(): the environments of shardwise run / torchrun, mpirun and a rank table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.communication import LaunchEnvError, detect_job


def test_plain_process_is_one_rank() -> None:
    job = detect_job({})
    assert (job.rank, job.world_size, job.local_rank, job.source) == (0, 1, 0, "single process")


def test_shardwise_run_env() -> None:
    env = {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "9000", "SHARDWISE_RUN": "1",
    }  # fmt: skip
    job = detect_job(env)
    assert (job.rank, job.world_size, job.local_rank, job.node_rank) == (5, 8, 1, 1)
    assert (job.master_addr, job.master_port, job.source) == ("10.0.0.1", 9000, "shardwise run")
    assert "rank 5/8" in str(job)


def test_torchrun_env_defaults() -> None:
    job = detect_job({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1234"})
    assert (job.source, job.master_addr, job.master_port, job.local_world_size) == (
        "torchrun", "127.0.0.1", 1234, 2,
    )  # fmt: skip


def test_mpirun_env() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }  # fmt: skip
    job = detect_job(env)
    assert (job.rank, job.world_size, job.local_rank, job.source) == (3, 4, 3, "mpirun")
    assert (job.master_addr, job.master_port) == ("127.0.0.1", 8118)


def test_mpirun_multi_node_needs_master_addr() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }  # fmt: skip
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR is not set"):
        detect_job(env)
    job = detect_job({**env, "MS_SCHED_HOST": "node0", "MS_SCHED_PORT": "7000"})
    assert (job.master_addr, job.master_port, job.node_rank) == ("node0", 7000, 1)


def _rank_table(tmp_path: Path, servers: list[tuple[str, list[int]]]) -> str:
    table = {
        "version": "1.0",
        "server_count": str(len(servers)),
        "server_list": [
            {
                "server_id": host,
                "device": [
                    {"device_id": str(i), "device_ip": "0.0.0.0", "rank_id": str(r)}
                    for i, r in enumerate(ranks)
                ],
                "host_nic_ip": "reserve",
            }
            for host, ranks in servers
        ],
        "status": "completed",
    }
    path = tmp_path / "rank_table.json"
    path.write_text(json.dumps(table))
    return str(path)


def test_rank_table(tmp_path: Path) -> None:
    path = _rank_table(tmp_path, [("127.0.0.1", [0, 1]), ("127.0.0.2", [2, 3])])
    job = detect_job({"RANK_TABLE_FILE": path, "RANK_ID": "3", "RANK_SIZE": "4"})
    assert (job.rank, job.world_size, job.local_rank, job.node_rank) == (3, 4, 1, 1)
    assert (job.master_addr, job.source) == ("127.0.0.1", "rank table")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK_ID": "9", "RANK_SIZE": "2"}, "RANK_ID=9 is not in the rank table"),
        ({"RANK_ID": "0", "RANK_SIZE": "3"}, "RANK_SIZE=3 but the rank table"),
        ({"RANK_SIZE": "2"}, "RANK_ID is not set"),
        ({"RANK_ID": "x", "RANK_SIZE": "2"}, "RANK_ID='x' is not an integer"),
    ],
)
def test_rank_table_errors(tmp_path: Path, env: dict[str, str], message: str) -> None:
    path = _rank_table(tmp_path, [("127.0.0.1", [0, 1])])
    with pytest.raises(LaunchEnvError, match=message):
        detect_job({"RANK_TABLE_FILE": path, **env})


def test_rank_table_missing_or_corrupt(tmp_path: Path) -> None:
    with pytest.raises(LaunchEnvError, match="does not exist"):
        detect_job({"RANK_TABLE_FILE": str(tmp_path / "nope.json"), "RANK_ID": "0"})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(LaunchEnvError, match="is not a rank table"):
        detect_job({"RANK_TABLE_FILE": str(bad), "RANK_ID": "0"})


def test_rank_outside_world() -> None:
    with pytest.raises(LaunchEnvError, match="rank 4 is outside"):
        detect_job({"RANK": "4", "WORLD_SIZE": "4"})
