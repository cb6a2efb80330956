"""How the launchers of one job find each other: torch's ``TCPStore``, hosted by node 0.

Steps (one launcher):

1. `Rendezvous.connect`: host or join the store (`store.open_store`); the host writes its
   ``worker_num`` and a fresh run id, clients read them (a client of another ``worker_num`` is
   refused, and the others told).
2. `Rendezvous.claim_node_rank`: an explicit ``--node_rank`` is claimed with ``compare_set``
   (a duplicate is an error); ``-1`` takes 0 on the host and the next free number from a
   counter (``store.add``) elsewhere.
3. `Rendezvous.register`: the launcher adds its ``local_worker_num`` to the job's worker count
   and writes a member record; a launcher whose workers would exceed ``worker_num`` is refused.
4. `Rendezvous.wait_for_all`: polls until the records add up to ``worker_num``, then orders
   the nodes by claimed rank: node ``n`` gets the ranks after those of nodes ``0..n-1``.
   After ``--cluster_time_out`` seconds it fails, saying how many workers joined and which
   launchers to start.

While the job runs, the store also carries the first failure (`publish_failure` /
`failure`, first writer wins), every launcher's heartbeat (`heartbeat`: a `liveness.Heartbeat`
thread on its own connection, watching the others' too) and the launchers that are done
(`mark_finished` / `finished_count`). All keys live under the
``shardwise_launch/`` prefix; the workers use ``job/<run id>/`` (see `communication.init`).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass

from shardwise._torch.c10d import PrefixStore, TCPStore
from shardwise.launch.config import LaunchConfig, NodeAssignment
from shardwise.launch.errors import LauncherInterrupted, RendezvousError
from shardwise.launch.liveness import Heartbeat, Peer
from shardwise.launch.report import RootCause
from shardwise.launch.schedlog import SchedulerLog
from shardwise.launch.store import StopCheck, open_store

KEY_PREFIX = "shardwise_launch"
POLL_S = 0.1
PROGRESS_EVERY_S = 5.0
REGISTER_RETRY_S = 1.0
"""Seconds a launcher whose workers pass ``--worker_num`` waits before its one more try."""
HEARTBEAT_TIMEOUT_S = 10.0
LINGER_S = 1.0


@dataclass(frozen=True)
class Member:
    """One launcher's registration record."""

    node: int
    workers: int
    explicit: bool
    after: int
    host: str
    pid: int

    @staticmethod
    def from_json(raw: bytes) -> Member:
        """Parse a record written by `Rendezvous.register`."""
        return Member(**json.loads(raw))


class Rendezvous:
    """One launcher's handle on the job's store (see the module docstring for the steps)."""

    def __init__(self, server: TCPStore, hosting: bool, cfg: LaunchConfig, stop: StopCheck) -> None:
        self.server = server
        self.store = PrefixStore(KEY_PREFIX, server)
        self.hosting = hosting
        self.cfg = cfg
        self.stop = stop
        self.run_id = ""
        self.node_claim = -1
        self.nodes: list[Member] = []
        self.hb: Heartbeat | None = None

    # -- step 1 -------------------------------------------------------------------------------
    @staticmethod
    def connect(
        cfg: LaunchConfig, log: SchedulerLog, deadline: float, stop: StopCheck
    ) -> Rendezvous:
        """Host the store or join it (step 1), and learn the run id.

        Args:
            cfg: the launcher's options.
            log: the scheduler log.
            deadline: `time.monotonic()` value after which to give up.
            stop: polled while waiting; a signal number aborts.

        Returns:
            A connected `Rendezvous`.

        Raises:
            RendezvousError: cannot host where required, or the store is unreachable.
            LauncherInterrupted: a stop signal arrived.
        """
        server, hosting = open_store(cfg, log, deadline, stop)
        rdv = Rendezvous(server, hosting, cfg, stop)
        where = f"{cfg.master_addr}:{cfg.master_port}"
        if hosting:
            rdv.run_id = uuid.uuid4().hex[:12]
            rdv.store.set("worker_num", str(cfg.worker_num))  # (before the run id clients wait for)
            rdv.store.set("run_id", rdv.run_id)
        else:
            rdv.run_id = rdv._wait_key("run_id", deadline).decode()
            theirs = int(rdv.store.get("worker_num"))
            if theirs != cfg.worker_num:
                host = socket.gethostname()
                message = (
                    f"--worker_num differs between the launchers of the job at {where}: "
                    f"{theirs} where the store is hosted, {cfg.worker_num} on {host}; start "
                    "every launcher with the same --worker_num (the job's total)"
                )
                rdv.publish_failure(RootCause(message, cfg.node_rank, host))
                raise RendezvousError(message)
        role = "hosting" if hosting else "joined"
        log.info(f"{role} the rendezvous store at {where}, run id {rdv.run_id}")
        return rdv

    def _sleep(self, seconds: float = POLL_S) -> None:
        time.sleep(seconds)
        signum = self.stop()
        if signum is not None:
            raise LauncherInterrupted(signum)

    def _wait_key(self, key: str, deadline: float) -> bytes:
        while not self.store.check([key]):
            if time.monotonic() >= deadline:
                raise RendezvousError(f"the rendezvous store never published {key!r}")
            self._sleep()
        return self.store.get(key)

    # -- step 2 -------------------------------------------------------------------------------
    def _claim(self, node: int, me: str) -> bool:
        return self.store.compare_set(f"node/{node}", "", me).decode() == me

    def claim_node_rank(self) -> int:
        """Claim this launcher's node number (step 2); see the module docstring.

        Returns:
            The claimed number (the final node rank is its position among the claims).

        Raises:
            RendezvousError: the explicit ``--node_rank`` is already taken.
        """
        me = f"{socket.gethostname()} pid {os.getpid()} ({uuid.uuid4().hex[:6]})"
        wanted = 0 if self.cfg.single_node else self.cfg.node_rank
        if wanted < 0 and self.hosting and self._claim(0, me):
            wanted = 0
        elif wanted >= 0:
            if not self._claim(wanted, me):
                owner = self.store.get(f"node/{wanted}").decode()
                raise RendezvousError(
                    f"--node_rank {wanted} is already taken by the launcher on {owner}: give "
                    "every launcher its own --node_rank, or -1 to be given one"
                )
        else:
            wanted = self.store.add("auto_node", 1) - 1
            while not self._claim(wanted, me):
                wanted = self.store.add("auto_node", 1) - 1
        self.node_claim = wanted
        return wanted

    # -- step 3 -------------------------------------------------------------------------------
    # (a launcher whose workers pass the count tries once more after REGISTER_RETRY_S: one
    # refused at the same moment takes its own back)
    def register(self) -> None:
        """Add this launcher's workers to the job (step 3).

        Raises:
            RendezvousError: this launcher's workers would pass ``worker_num`` (it is then not
                counted: a launcher with the right count may still join).
        """
        cfg = self.cfg
        index = self.store.add("registrations", 1)
        after = self.store.add("workers", cfg.local_worker_num)
        if after > cfg.worker_num:  # (a launcher refused at that moment may still take it back)
            self.store.add("workers", -cfg.local_worker_num)
            time.sleep(REGISTER_RETRY_S)
            after = self.store.add("workers", cfg.local_worker_num)
        if after > cfg.worker_num:  # (refused: its workers not counted, its record not written)
            self.store.add("workers", -cfg.local_worker_num)
            self.store.delete_key(f"node/{self.node_claim}")  # (its node rank free again)
            raise RendezvousError(
                f"the job at {cfg.master_addr}:{cfg.master_port} has {after - cfg.local_worker_num}"
                f" of its {cfg.worker_num} workers (--worker_num); this launcher's "
                f"{cfg.local_worker_num} are too many. Another job on this port? Pick a free "
                "--master_port; else check --worker_num and --local_worker_num of every launcher"
            )
        member = Member(
            node=self.node_claim,
            workers=cfg.local_worker_num,
            explicit=cfg.node_rank >= 0 and not cfg.single_node,
            after=after,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        self.store.set(f"member/{index}", json.dumps(asdict(member)))

    def members(self) -> list[Member]:
        """The registration records written so far, in registration order."""
        count = self.store.add("registrations", 0)
        keys = [f"member/{i}" for i in range(1, count + 1)]
        present = [k for k in keys if self.store.check([k])]
        return [Member.from_json(raw) for raw in self.store.multi_get(present)] if present else []

    # -- step 4 -------------------------------------------------------------------------------
    def wait_for_all(self, deadline: float, log: SchedulerLog) -> NodeAssignment:
        """Wait until ``worker_num`` workers have registered (step 4) and assign ranks.

        Args:
            deadline: `time.monotonic()` value of the ``--cluster_time_out``.
            log: the scheduler log (progress every few seconds).

        Returns:
            This node's `NodeAssignment`.

        Raises:
            RendezvousError: timeout (also published to the other launchers), another
                launcher's failure, or node ranks with gaps.
            LauncherInterrupted: a stop signal arrived.
        """
        n = self.cfg.worker_num
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        while True:
            root = self.failure()
            if root is not None:
                raise RendezvousError(f"another launcher gave up: {root.reason}")
            joined = [m for m in self.members() if m.after <= n]
            count = sum(m.workers for m in joined)
            if count == n:
                return self._assign(joined)
            now = time.monotonic()
            if now >= deadline:
                message = self._timeout_message(joined, count)
                self.publish_failure(RootCause(message, self.node_claim, socket.gethostname()))
                if self.hosting and len(joined) > 1:
                    time.sleep(LINGER_S)  # keep the store up while the others read why
                raise RendezvousError(message)
            if now >= next_progress:
                log.info(f"waiting for workers: {count} of {n} joined")
                next_progress = now + PROGRESS_EVERY_S
            self._sleep()

    def _assign(self, joined: list[Member]) -> NodeAssignment:
        ordered = sorted(joined, key=lambda m: m.node)
        if any(m.explicit and m.node != pos for pos, m in enumerate(ordered)):
            claimed = ", ".join(str(m.node) for m in ordered)
            raise RendezvousError(
                f"node ranks must be 0..{len(ordered) - 1} without gaps, but the launchers "
                f"that joined have --node_rank {claimed}"
            )
        self.nodes = ordered
        pos = next(i for i, m in enumerate(ordered) if m.node == self.node_claim)
        cfg = self.cfg
        return NodeAssignment(
            run_id=self.run_id,
            node_rank=pos,
            num_nodes=len(ordered),
            rank_offset=sum(m.workers for m in ordered[:pos]),
            local_worker_num=cfg.local_worker_num,
            worker_num=cfg.worker_num,
            master_addr=cfg.master_addr,
            master_port=cfg.master_port,
            cluster_time_out=cfg.cluster_time_out,
        )

    def _timeout_message(self, joined: list[Member], count: int) -> str:
        cfg = self.cfg
        n, k = cfg.worker_num, cfg.local_worker_num
        hint = "--node_rank -1"
        if n % k == 0:
            missing = [r for r in range(n // k) if r not in {m.node for m in joined}]
            if missing:
                each = " (one launcher each)" if len(missing) > 1 else ""
                hint = f"--node_rank {', '.join(map(str, missing))}{each}"
        nodes = ", ".join(f"node {m.node} on {m.host} with {m.workers}" for m in joined)
        return (
            f"only {count} of {n} workers joined after {cfg.cluster_time_out:g} s "
            f"(joined: {nodes or 'none'}): "
            f"start the other launchers with {hint} and the same --worker_num {n} "
            f"--master_addr {cfg.master_addr} --master_port {cfg.master_port}, "
            "or raise --cluster_time_out"
        )

    # -- while the job runs -------------------------------------------------------------------
    def publish_failure(self, root: RootCause) -> RootCause:
        """Record `root` as the job's failure unless one is recorded already.

        Returns:
            The recorded failure (the earlier one when another launcher was first).
        """
        return RootCause.from_json(self.store.compare_set("failed", "", root.to_json()))

    def failure(self) -> RootCause | None:
        """The job's recorded failure, if any."""
        if not self.store.check(["failed"]):
            return None
        return RootCause.from_json(self.store.get("failed"))

    def peers(self) -> list[Peer]:
        """The other launchers of the job, with their node ranks (after `wait_for_all`)."""
        return [
            Peer(pos, m.node, m.host, m.pid)
            for pos, m in enumerate(self.nodes)
            if m.node != self.node_claim
        ]

    def start_heartbeat(self) -> None:
        """Start `hb`, this launcher's `Heartbeat`, on a connection of its own (several nodes)."""
        client = TCPStore(
            self.cfg.master_addr,
            self.cfg.master_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=HEARTBEAT_TIMEOUT_S),
        )
        store = PrefixStore(KEY_PREFIX, client)
        self.hb = Heartbeat(store, self.node_claim, self.peers()).start()

    def mark_finished(self) -> None:
        """Tell the others this launcher is done (its workers have all exited)."""
        self.store.set(f"done/{self.node_claim}", "1")
        self.store.add("finished", 1)

    def finished_count(self) -> int:
        """How many launchers are done."""
        return self.store.add("finished", 0)
