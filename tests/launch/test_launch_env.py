"""Each worker's environment and CPU cores (pure functions), and the contract with
`shardwise.communication.detect_job`: what the launcher sets is what `init()` reads."""

from __future__ import annotations

import pytest

from shardwise.communication import detect_job
from shardwise.launch.config import NodeAssignment
from shardwise.launch.env import omp_threads, split_cores, worker_env

JOB = NodeAssignment(
    run_id="abc123",
    node_rank=1,
    num_nodes=2,
    rank_offset=4,
    local_worker_num=4,
    worker_num=8,
    master_addr="10.0.0.1",
    master_port=9000,
    cluster_time_out=60,
)


def test_worker_env_sets_torch_and_mindspore_names() -> None:
    env = worker_env({"PATH": "/bin"}, JOB, 2)
    assert env["PATH"] == "/bin"
    expected = {
        "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "9000",
        "SHARDWISE_RUN": "1", "SHARDWISE_RUN_ID": "abc123",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "PYTHONUNBUFFERED": "1",
        "RANK_ID": "6", "RANK_SIZE": "8", "DEVICE_ID": "2", "MS_WORKER_NUM": "8",
        "MS_LOCAL_WORKER": "4", "MS_NODE_RANK": "1", "MS_SCHED_HOST": "10.0.0.1",
        "MS_SCHED_PORT": "9000", "MS_ROLE": "MS_WORKER", "MS_NODE_ID": "6",
        "MS_TOPO_TIMEOUT": "60",
    }  # fmt: skip
    assert {k: env[k] for k in expected} == expected


def test_worker_env_is_what_detect_job_reads() -> None:
    for local in range(4):
        job = detect_job(worker_env({}, JOB, local))
        assert (job.rank, job.world_size) == (4 + local, 8)
        assert (job.local_rank, job.local_world_size, job.node_rank) == (local, 4, 1)
        assert (job.master_addr, job.master_port) == ("10.0.0.1", 9000)
        assert job.source == "shardwise run"


def test_worker_env_drops_other_launchers_variables() -> None:
    base = {
        "OMPI_COMM_WORLD_RANK": "3",
        "RANK_TABLE_FILE": "/x.json",
        "TORCHELASTIC_RUN_ID": "old",
        "NODE_RANK": "7",
        "HOME": "/root",
    }
    env = worker_env(base, JOB, 0)
    assert "OMPI_COMM_WORLD_RANK" not in env and "RANK_TABLE_FILE" not in env
    assert "TORCHELASTIC_RUN_ID" not in env and "NODE_RANK" not in env
    assert env["HOME"] == "/root" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert base["NODE_RANK"] == "7"  # the input is not modified


def test_worker_env_threads() -> None:
    assert worker_env({"OMP_NUM_THREADS": "3"}, JOB, 0)["OMP_NUM_THREADS"] == "3"
    assert worker_env({}, JOB, 0, cores=[4, 5])["OMP_NUM_THREADS"] == "2"
    assert int(worker_env({}, JOB, 0)["OMP_NUM_THREADS"]) >= 1
    assert omp_threads(4, None, cpu_count=16) == 4
    assert omp_threads(8, None, cpu_count=2) == 1


def test_worker_env_rejects_a_bad_local_rank() -> None:
    with pytest.raises(ValueError, match="local rank 4 is outside"):
        worker_env({}, JOB, 4)


def test_assignment_ranks() -> None:
    assert list(JOB.ranks) == [4, 5, 6, 7]
    assert JOB.rank(0) == 4


@pytest.mark.parametrize(
    ("cores", "n", "expected"),
    [
        ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1], [2, 3, 4]]),
        ([0, 1, 2, 3, 4, 5, 6, 7], 3, [[0, 1], [2, 3, 4], [5, 6, 7]]),
        ([0, 1], 2, [[0], [1]]),
        ([0, 1], 4, [[0], [1], [0], [1]]),
        ([5], 3, [[5], [5], [5]]),
        ([2, 4, 6], 1, [[2, 4, 6]]),
    ],
)
def test_split_cores(cores: list[int], n: int, expected: list[list[int]]) -> None:
    assert split_cores(cores, n) == expected


def test_split_cores_is_disjoint_when_it_can_be() -> None:
    for n in range(1, 17):
        sets = split_cores(list(range(16)), n)
        flat = [c for s in sets for c in s]
        assert sorted(flat) == list(range(16)) and all(sets)


def test_split_cores_errors() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        split_cores([0], 0)
    with pytest.raises(ValueError, match="no CPU cores"):
        split_cores([], 2)
