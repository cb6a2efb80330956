"""Find out which job this process belongs to, from the launcher's environment.

`detect_job()` reads, in order:

1. ``shardwise run`` / torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``GROUP_RANK`` (node rank), ``MASTER_ADDR``, ``MASTER_PORT`` (``SHARDWISE_RUN=1`` marks ours);
2. mpirun (Open MPI): ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
   ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``, with the rendezvous address
   from ``MASTER_ADDR``/``MASTER_PORT`` (or MindSpore's ``MS_SCHED_HOST``/``MS_SCHED_PORT``;
   127.0.0.1:8118 when every rank is on one node);
3. a MindSpore rank table: ``RANK_TABLE_FILE``, ``RANK_ID``, ``RANK_SIZE`` (the first server's
   ``server_id`` is the rendezvous host, ``MASTER_PORT`` or 8118 the port);
4. nothing: a 1-rank job.

The result is a frozen `JobEnv`; `detect_job()` never touches a process group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 8118


class LaunchEnvError(ValueError):
    """The launcher's environment is incomplete or inconsistent."""


@dataclass(frozen=True)
class JobEnv:
    """Where this process sits in the job.

    Attributes:
        rank: global rank.
        world_size: number of ranks in the job.
        local_rank: rank on this node (the device index with CUDA).
        local_world_size: ranks on this node.
        node_rank: index of this node.
        master_addr: host of the rendezvous store (rank 0's TCPStore).
        master_port: port of the rendezvous store.
        source: which launcher's variables were read.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str

    def __str__(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/"
            f"{self.local_world_size}, node {self.node_rank}) via {self.source}, "
            f"store {self.master_addr}:{self.master_port}"
        )


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise LaunchEnvError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvError(f"environment variable {name}={raw!r} is not an integer") from None


def _check(job: JobEnv) -> JobEnv:
    if job.world_size < 1:
        raise LaunchEnvError(f"world size must be >= 1, got {job.world_size} ({job.source})")
    if not 0 <= job.rank < job.world_size:
        raise LaunchEnvError(
            f"rank {job.rank} is outside [0, {job.world_size}) ({job.source}); "
            "check RANK / RANK_ID against WORLD_SIZE / RANK_SIZE"
        )
    if not 0 <= job.local_rank < max(job.local_world_size, 1):
        raise LaunchEnvError(
            f"local rank {job.local_rank} is outside [0, {job.local_world_size}) ({job.source})"
        )
    return job


def _master(env: Mapping[str, str], single_node: bool, source: str) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR") or env.get("MS_SCHED_HOST")
    port_name = "MASTER_PORT" if env.get("MASTER_PORT") else "MS_SCHED_PORT"
    if not addr:
        if not single_node:
            raise LaunchEnvError(
                f"{source} job spans several nodes but MASTER_ADDR is not set: export "
                "MASTER_ADDR=<host of rank 0> and MASTER_PORT=<free port> on every node"
            )
        addr = DEFAULT_MASTER_ADDR
    return addr, _int(env, port_name, DEFAULT_MASTER_PORT)


def _from_torchrun(env: Mapping[str, str]) -> JobEnv:
    source = "shardwise run" if env.get("SHARDWISE_RUN") == "1" else "torchrun"
    world = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    addr, port = _master(env, local_world == world, source)
    return JobEnv(
        rank=_int(env, "RANK"),
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", 0),
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", _int(env, "NODE_RANK", 0)),
        master_addr=addr,
        master_port=port,
        source=source,
    )


def _from_mpirun(env: Mapping[str, str]) -> JobEnv:
    world = _int(env, "OMPI_COMM_WORLD_SIZE")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    addr, port = _master(env, local_world == world, "mpirun")
    return JobEnv(
        rank=rank,
        world_size=world,
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", rank),
        local_world_size=local_world,
        node_rank=_int(env, "OMPI_COMM_WORLD_NODE_RANK", rank // max(local_world, 1)),
        master_addr=addr,
        master_port=port,
        source="mpirun",
    )


def _from_rank_table(env: Mapping[str, str]) -> JobEnv:
    path = env["RANK_TABLE_FILE"]
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
        servers = table["server_list"]
        devices = [(int(d["rank_id"]), i, s) for i, s in enumerate(servers) for d in s["device"]]
    except FileNotFoundError:
        raise LaunchEnvError(f"RANK_TABLE_FILE={path!r} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LaunchEnvError(
            f"RANK_TABLE_FILE={path!r} is not a rank table ({type(e).__name__}: {e}); expected "
            '{"server_list": [{"server_id": host, "device": [{"device_id", "rank_id"}]}]}'
        ) from None
    rank = _int(env, "RANK_ID")
    world = _int(env, "RANK_SIZE", len(devices))
    if world != len(devices):
        raise LaunchEnvError(
            f"RANK_SIZE={world} but the rank table {path!r} lists {len(devices)} devices"
        )
    mine = [(node, s) for r, node, s in devices if r == rank]
    if not mine:
        raise LaunchEnvError(f"RANK_ID={rank} is not in the rank table {path!r}")
    node, server = mine[0]
    local_ranks = sorted(int(d["rank_id"]) for d in server["device"])
    addr = env.get("MASTER_ADDR") or str(servers[0].get("server_id", DEFAULT_MASTER_ADDR))
    return JobEnv(
        rank=rank,
        world_size=world,
        local_rank=_int(env, "DEVICE_ID", local_ranks.index(rank)),
        local_world_size=len(local_ranks),
        node_rank=node,
        master_addr=addr,
        master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
        source="rank table",
    )


def detect_job(env: Mapping[str, str] | None = None) -> JobEnv:
    """Read the job's shape from the environment (see the module docstring for the order).

    Args:
        env: the environment to read; `os.environ` when None.

    Returns:
        The `JobEnv` of this process.

    Raises:
        LaunchEnvError: the variables are incomplete or inconsistent; the message names them.

    Example:
        >>> detect_job({}).world_size
        1
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        job = _from_torchrun(env)
    elif "OMPI_COMM_WORLD_RANK" in env:
        job = _from_mpirun(env)
    elif "RANK_TABLE_FILE" in env:
        job = _from_rank_table(env)
    else:
        job = JobEnv(0, 1, 0, 1, 0, DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, "single process")
    return _check(job)
