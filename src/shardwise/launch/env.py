"""What each worker process gets: its environment and, with ``--bind_core``, its CPU cores.

- `worker_env`: the variables `shardwise.communication.init()` reads (torchrun's names and
  MindSpore's msrun names), added to the launcher's own environment.
- `split_cores`: disjoint sets of CPU cores, one per local worker (shared round-robin when
  there are fewer cores than workers).
- `omp_threads`: the ``OMP_NUM_THREADS`` a worker gets when the user did not set one.

All three are pure functions: no process is started here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from shardwise.launch.config import NodeAssignment

# Variables of other launchers that would contradict ours if inherited by a worker.
_STALE_PREFIXES = ("OMPI_COMM_WORLD_", "TORCHELASTIC_")
_STALE_NAMES = frozenset({"RANK_TABLE_FILE", "NODE_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK"})


def worker_env(
    base: Mapping[str, str],
    job: NodeAssignment,
    local_rank: int,
    cores: Sequence[int] | None = None,
) -> dict[str, str]:
    """The environment of local worker `local_rank` of this node.

    Variables of other launchers (``OMPI_COMM_WORLD_*``, ``TORCHELASTIC_*``,
    ``RANK_TABLE_FILE``, ``NODE_RANK``) are dropped from `base` so that `detect_job()` cannot
    mix two launchers' views of the job.

    Args:
        base: the launcher's environment (usually `os.environ`).
        job: this node's place in the job, from the rendezvous.
        local_rank: index of the worker on this node, in ``[0, job.local_worker_num)``.
        cores: the CPU cores the worker is pinned to (``--bind_core True``), or None.

    Returns:
        A new dict: `base` plus ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
        ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``SHARDWISE_RUN``,
        ``SHARDWISE_RUN_ID``, ``TORCHELASTIC_USE_AGENT_STORE``, ``PYTHONUNBUFFERED``,
        ``OMP_NUM_THREADS`` (unless set in `base`) and MindSpore's ``RANK_ID``, ``RANK_SIZE``,
        ``DEVICE_ID``, ``MS_WORKER_NUM``, ``MS_LOCAL_WORKER``, ``MS_NODE_RANK``,
        ``MS_SCHED_HOST``, ``MS_SCHED_PORT``, ``MS_ROLE``, ``MS_NODE_ID``, ``MS_TOPO_TIMEOUT``.

    Raises:
        ValueError: `local_rank` is outside the node's workers.

    Example:
        >>> job = NodeAssignment("ab12", 1, 2, 4, 4, 8, "10.0.0.1", 8118)
        >>> worker_env({}, job, 2)["RANK"]
        '6'
    """
    if not 0 <= local_rank < job.local_worker_num:
        raise ValueError(
            f"local rank {local_rank} is outside [0, {job.local_worker_num}) "
            f"on node {job.node_rank}"
        )
    env = {
        k: v for k, v in base.items() if k not in _STALE_NAMES and not k.startswith(_STALE_PREFIXES)
    }
    rank = str(job.rank(local_rank))
    ours = {
        "RANK": rank,
        "WORLD_SIZE": str(job.worker_num),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(job.local_worker_num),
        "GROUP_RANK": str(job.node_rank),
        "MASTER_ADDR": job.master_addr,
        "MASTER_PORT": str(job.master_port),
        "SHARDWISE_RUN": "1",
        "SHARDWISE_RUN_ID": job.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "PYTHONUNBUFFERED": "1",
        # MindSpore's msrun names, for scripts ported from MindSpore.
        "RANK_ID": rank,
        "RANK_SIZE": str(job.worker_num),
        "DEVICE_ID": str(local_rank),
        "MS_WORKER_NUM": str(job.worker_num),
        "MS_LOCAL_WORKER": str(job.local_worker_num),
        "MS_NODE_RANK": str(job.node_rank),
        "MS_SCHED_HOST": job.master_addr,
        "MS_SCHED_PORT": str(job.master_port),
        "MS_ROLE": "MS_WORKER",
        "MS_NODE_ID": rank,
        "MS_TOPO_TIMEOUT": f"{job.cluster_time_out:g}",
    }
    env.update(ours)
    if "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = str(omp_threads(job.local_worker_num, cores))
    return env


def omp_threads(local_worker_num: int, cores: Sequence[int] | None, cpu_count: int = 0) -> int:
    """Threads per worker so that the node's workers do not oversubscribe its cores.

    Args:
        local_worker_num: workers on this node.
        cores: the worker's pinned cores, or None when not pinned.
        cpu_count: cores usable by the launcher; 0 means ask the OS.

    Returns:
        ``len(cores)`` when pinned, else ``cpu_count // local_worker_num`` (at least 1).

    Example:
        >>> omp_threads(4, None, cpu_count=16)
        4
    """
    if cores:
        return len(cores)
    if cpu_count <= 0:
        cpu_count = len(usable_cores())
    return max(1, cpu_count // max(local_worker_num, 1))


def usable_cores() -> list[int]:
    """The CPU cores this process may run on, sorted (its affinity mask).

    Example:
        >>> len(usable_cores()) >= 1
        True
    """
    return sorted(os.sched_getaffinity(0))


def split_cores(cores: Sequence[int], n: int) -> list[list[int]]:
    """Split `cores` into `n` sets, one per worker.

    With at least `n` cores the sets are disjoint, contiguous and differ in size by at most one
    (the first ones are never larger than the last ones). With fewer cores than workers each
    worker gets one core, and cores are shared round-robin.

    Args:
        cores: the usable core ids (see `usable_cores`).
        n: number of workers, >= 1.

    Returns:
        `n` non-empty lists of core ids.

    Raises:
        ValueError: no cores, or `n` < 1.

    Example:
        >>> split_cores([0, 1, 2, 3, 4], 2)
        [[0, 1], [2, 3, 4]]
        >>> split_cores([0, 1], 3)
        [[0], [1], [0]]
    """
    if n < 1:
        raise ValueError(f"split_cores: need at least one worker, got {n}")
    if not cores:
        raise ValueError("split_cores: no CPU cores to bind to")
    ordered = list(cores)
    if len(ordered) < n:
        return [[ordered[i % len(ordered)]] for i in range(n)]
    return [ordered[i * len(ordered) // n : (i + 1) * len(ordered) // n] for i in range(n)]
