"""Whether the other launchers of a multi-node job are still there: heartbeats in the store.

- `Heartbeat`: a daemon thread with its own connection to the job's store. Every `BEAT_S` it
  adds 1 to this launcher's ``beat/<node>`` counter and reads the other launchers' counters
  and ``done/<node>`` flags, noting when each counter last moved. Being a thread of its own, it
  keeps beating while the launcher's main loop is busy (stopping workers takes seconds).
- `Heartbeat.lost`: the unfinished launchers whose counter has not moved for `node_timeout`
  seconds (``SHARDWISE_NODE_TIMEOUT``, default `LOST_S`): their
  process was killed, or their machine went down or off the network.
- `Heartbeat.settle`: after a local worker failed, wait until every other launcher has shown
  that it is alive (its counter moved since) or lost, so that the report can name a lost node,
  not the local worker that failed because that node's workers vanished.
- `lost_cause` / `store_lost_cause`: the `RootCause` of a lost node (by heartbeat), or of a
  lost node 0 (its store is gone).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise._envvars import env_seconds
from shardwise.launch.report import RootCause

BEAT_S = 0.5
LOST_S = 5.0
"""Seconds without a heartbeat after which a launcher counts as lost, unless
``SHARDWISE_NODE_TIMEOUT`` says otherwise (`node_timeout`)."""
MIN_LOST_S = 2 * BEAT_S
"""The least ``SHARDWISE_NODE_TIMEOUT``: less than two beats would find healthy launchers lost."""
_KEEP = 32  # counter values remembered per launcher


def node_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds without a heartbeat after which a launcher counts as lost:
    ``$SHARDWISE_NODE_TIMEOUT``, else `LOST_S`.

    Raises:
        ValueError: the variable is not a number of seconds, `MIN_LOST_S` or more (names it; the
            launcher refuses it before it starts, `cli.parse_run_args`).

    Example:
        >>> node_timeout({"SHARDWISE_NODE_TIMEOUT": "12"})
        12.0
    """
    return env_seconds("SHARDWISE_NODE_TIMEOUT", LOST_S, minimum=MIN_LOST_S, env=env)


@dataclass(frozen=True)
class Peer:
    """Another launcher of the job: its node rank, claimed number (store keys), host, pid."""

    node_rank: int
    claim: int
    host: str
    pid: int


class Heartbeat:
    """This launcher's heartbeat, and what it has seen of the others' (module docstring).

    Args:
        store: a store connection used by this thread only (keys under the launchers' prefix).
        claim: this launcher's claimed node number (its ``beat/<claim>`` key).
        peers: the other launchers.
        interval: seconds between beats.
        lost_s: seconds without a beat after which a launcher is lost (`node_timeout` when
            None).
    """

    def __init__(
        self,
        store: Any,
        claim: int,
        peers: Sequence[Peer],
        interval: float = BEAT_S,
        lost_s: float | None = None,
    ):
        self.lost_s = node_timeout() if lost_s is None else lost_s
        self._store = store
        self._claim = claim
        self._peers = list(peers)
        self._interval = interval
        now = time.monotonic()
        self._seen: dict[int, list[tuple[float, int]]] = {p.claim: [] for p in self._peers}
        self._moved: dict[int, float] = {p.claim: now for p in self._peers}
        self._done: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")

    def start(self) -> Heartbeat:
        """Beat once now, then every `interval` seconds in the background; returns self."""
        self._tick()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating (idempotent); the others will see this launcher as lost unless it is
        done (``done/<node>`` set by `Rendezvous.mark_finished`)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self._interval + 1.0)

    def _tick(self) -> None:
        self._store.add(f"beat/{self._claim}", 1)
        for p in self._peers:
            if p.claim in self._done:
                continue
            done = self._store.check([f"done/{p.claim}"])
            count = self._store.add(f"beat/{p.claim}", 0)
            with self._lock:
                if done:
                    self._done.add(p.claim)
                elif not self._seen[p.claim] or self._seen[p.claim][-1][1] != count:
                    now = time.monotonic()
                    self._seen[p.claim] = [*self._seen[p.claim][-(_KEEP - 1) :], (now, count)]
                    self._moved[p.claim] = now

    def _run(self) -> None:
        failing_since: float | None = None
        while not self._stop.wait(self._interval):
            try:
                self._tick()
                failing_since = None
            except RuntimeError as e:  # a slow store, or gone: node 0's launcher exited
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since < self.lost_s:
                    continue  # a transient failure: beat again, as the others wait lost_s
                with self._lock:
                    self.error = (str(e).splitlines() or [type(e).__name__])[0]
                return

    def lost(self, after_s: float | None = None) -> list[Peer]:
        """The unfinished launchers whose heartbeat has not moved for `after_s` seconds
        (`lost_s` when None)."""
        after_s = self.lost_s if after_s is None else after_s
        now = time.monotonic()
        with self._lock:
            return [
                p
                for p in self._peers
                if p.claim not in self._done and now - self._moved[p.claim] > after_s
            ]

    def _beat_since(self, claim: int, since: float) -> bool:
        """Whether `claim` surely beat after `since`: its counter rose by 2 or more since the
        last value seen before `since` (one more may be a beat sent just before it died)."""
        seen = self._seen[claim]
        if not seen:
            return False
        before = [count for t, count in seen if t <= since] or [seen[0][1]]
        return seen[-1][1] >= before[-1] + 2

    def settle(self, since: float, after_s: float | None = None) -> list[Peer]:
        """Wait until each other launcher is done, surely beat after `since` (a
        `time.monotonic()` value), or is lost; at most about `after_s` seconds.

        Returns:
            The lost launchers.
        """
        after_s = self.lost_s if after_s is None else after_s
        deadline = time.monotonic() + after_s + 2 * self._interval
        while time.monotonic() < deadline:
            with self._lock:
                if self.error is not None:
                    break
                pending = [
                    p
                    for p in self._peers
                    if p.claim not in self._done and not self._beat_since(p.claim, since)
                ]
            if all(p in self.lost(after_s) for p in pending):
                break
            time.sleep(self._interval / 5)
        return self.lost(after_s)


def lost_cause(
    lost: Sequence[Peer], node_rank: int, host: str, after_s: float | None = None
) -> RootCause:
    """The root cause "node N (host H) lost", seen from this launcher (`node_rank`, `host`),
    after `after_s` seconds without a heartbeat (`node_timeout` when None).

    Example:
        >>> lost_cause([Peer(1, 1, "hostB", 4321)], 0, "hostA").reason.split(":")[0]
        'node 1 (host hostB) lost'
    """
    after_s = node_timeout() if after_s is None else after_s
    who = "; ".join(
        f"node {p.node_rank} (host {p.host}) lost: its launcher (pid {p.pid}) stopped sending "
        f"heartbeats for {after_s:g} s"
        for p in lost
    )
    return RootCause(
        f"{who} (killed, or its machine went down or off the network); its workers are gone "
        "with it, and the workers here were stopped",
        node_rank,
        host,
    )


def store_lost_cause(
    master: Peer | None, where: str, error: str, node_rank: int, host: str
) -> RootCause:
    """The root cause "node 0 lost": the job's store, hosted by node 0's launcher, is gone.

    Example:
        >>> store_lost_cause(None, "10.0.0.1:8118", "Connection reset", 1, "b").reason[:11]
        'node 0 lost'
    """
    who = "node 0" if master is None else f"node 0 (host {master.host})"
    pid = "" if master is None else f" (pid {master.pid})"
    return RootCause(
        f"{who} lost: its launcher{pid} stopped, and with it the job's store at {where} "
        f"({error}); the workers here were stopped",
        node_rank,
        host,
    )
