"""The launcher's plain data: what the user asked for and where this node landed.

- `LaunchConfig`: the validated command line of ``shardwise run`` (built by `cli.parse_run_args`).
- `NodeAssignment`: the result of the rendezvous for one launcher (built by
  `rendezvous.Rendezvous.wait_for_all`): run id, node rank, and the global ranks of its workers.

Neither class imports torch, so `cli` and `env` stay cheap to import and test.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LaunchConfig:
    """The options of one ``shardwise run`` invocation, validated.

    Attributes:
        script: path of the Python script every worker runs.
        script_args: arguments passed to the script untouched.
        worker_num: workers in the whole job (all nodes).
        local_worker_num: workers this launcher starts.
        master_addr: host of the rendezvous store (node 0's launcher hosts it).
        master_port: port of the rendezvous store.
        node_rank: index of this node, or -1 to be given one at the rendezvous.
        log_dir: folder of ``scheduler.log`` and ``worker_<rank>.log`` (created if missing).
        join: True: stay in the foreground until the job ends; False: return once the workers
            started, supervising them from the background (msrun's default).
        cluster_time_out: seconds to wait for all ``worker_num`` workers to join.
        bind_core: pin each worker to its own CPU cores.
    """

    script: str
    script_args: tuple[str, ...] = ()
    worker_num: int = 8
    local_worker_num: int = 8
    master_addr: str = "127.0.0.1"
    master_port: int = 8118
    node_rank: int = -1
    log_dir: str = "."
    join: bool = False
    cluster_time_out: float = 600.0
    bind_core: bool = False

    @property
    def single_node(self) -> bool:
        """Whether every worker runs on this node (then ``node_rank`` is ignored, as in msrun)."""
        return self.local_worker_num == self.worker_num

    @property
    def log_path(self) -> Path:
        """`log_dir` as an absolute path."""
        return Path(self.log_dir).resolve()

    def command_line(self) -> str:
        """The options as they would be typed (quoted for a shell), for the scheduler log and
        error messages.

        Example:
            >>> LaunchConfig("my train.py", ("a b", "")).command_line().partition("False ")[2]
            "--cluster_time_out 600 --bind_core False 'my train.py' 'a b' ''"
        """
        return shlex.join(
            [
                *("--worker_num", str(self.worker_num), "--local_worker_num"),
                *(str(self.local_worker_num), "--master_addr", self.master_addr),
                *("--master_port", str(self.master_port), "--node_rank", str(self.node_rank)),
                *("--log_dir", self.log_dir, "--join", str(self.join), "--cluster_time_out"),
                *(f"{self.cluster_time_out:g}", "--bind_core", str(self.bind_core)),
                *(self.script, *self.script_args),
            ]
        )


@dataclass(frozen=True)
class NodeAssignment:
    """Where one launcher's workers sit in the job, decided at the rendezvous.

    Ranks are given in node-rank order: node ``n``'s workers get the ranks after those of
    nodes ``0..n-1``, so with equal ``local_worker_num`` everywhere,
    ``rank = node_rank * local_worker_num + local_rank``.

    Attributes:
        run_id: the job's id, the same on every node (``SHARDWISE_RUN_ID``).
        node_rank: this node's index in ``[0, num_nodes)``.
        num_nodes: launchers in the job.
        rank_offset: global rank of this node's local rank 0.
        local_worker_num: workers on this node.
        worker_num: workers in the job.
        master_addr: host of the store the workers connect to.
        master_port: port of that store.
        cluster_time_out: the rendezvous timeout, exported as ``MS_TOPO_TIMEOUT``.
    """

    run_id: str
    node_rank: int
    num_nodes: int
    rank_offset: int
    local_worker_num: int
    worker_num: int
    master_addr: str
    master_port: int
    cluster_time_out: float = 600.0

    def rank(self, local_rank: int) -> int:
        """Global rank of local worker `local_rank`.

        Example:
            >>> NodeAssignment("x", 1, 2, 4, 4, 8, "h", 1).rank(2)
            6
        """
        return self.rank_offset + local_rank

    @property
    def ranks(self) -> range:
        """The global ranks of this node's workers."""
        return range(self.rank_offset, self.rank_offset + self.local_worker_num)
