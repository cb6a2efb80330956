"""The launchers' rendezvous on a real in-process TCPStore (no worker processes): who hosts,
node ranks, rank offsets, too many or too few workers, first-failure-wins, and heartbeats."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from shardwise.launch import rendezvous
from shardwise.launch.config import LaunchConfig
from shardwise.launch.errors import LauncherInterrupted, RendezvousError
from shardwise.launch.liveness import lost_cause
from shardwise.launch.rendezvous import Rendezvous
from shardwise.launch.report import RootCause
from shardwise.launch.schedlog import SchedulerLog
from shardwise.launch.store import probe_bind


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def log(tmp_path: Path) -> SchedulerLog:
    return SchedulerLog.open(tmp_path, truncate=True)


def _connect(port: int, log: SchedulerLog, timeout: float = 5.0, **kw: object) -> Rendezvous:
    cfg = LaunchConfig("x.py", master_port=port, cluster_time_out=timeout, **kw)  # type: ignore[arg-type]
    rdv = Rendezvous.connect(cfg, log, time.monotonic() + timeout, lambda: None)
    rdv.claim_node_rank()
    return rdv


def test_single_node_hosts_and_completes(log: SchedulerLog) -> None:
    rdv = _connect(_free_port(), log, worker_num=2, local_worker_num=2, node_rank=5)
    assert rdv.hosting and rdv.node_claim == 0  # node_rank is ignored on one node, as in msrun
    rdv.register()
    job = rdv.wait_for_all(time.monotonic() + 1, log)
    assert (job.node_rank, job.num_nodes, list(job.ranks)) == (0, 1, [0, 1])
    assert job.run_id == rdv.run_id and len(job.run_id) == 12


def test_auto_node_ranks_host_first_and_rank_offsets(log: SchedulerLog) -> None:
    port = _free_port()
    kw = {"worker_num": 5, "local_worker_num": 2}
    host = _connect(port, log, **kw)
    a = _connect(port, log, **kw)
    b = _connect(port, log, worker_num=5, local_worker_num=1)
    assert host.hosting and not a.hosting and not b.hosting
    assert (host.node_claim, a.node_claim, b.node_claim) == (0, 1, 2)
    assert a.run_id == host.run_id == b.run_id
    for r in (b, host, a):  # registration order does not matter: node order does
        r.register()
    jobs = [r.wait_for_all(time.monotonic() + 1, log) for r in (host, a, b)]
    assert [list(j.ranks) for j in jobs] == [[0, 1], [2, 3], [4]]
    assert [j.num_nodes for j in jobs] == [3, 3, 3]


def test_explicit_node_ranks(log: SchedulerLog) -> None:
    port = _free_port()
    one = _connect(port, log, worker_num=4, local_worker_num=2, node_rank=0)
    two = _connect(port, log, worker_num=4, local_worker_num=2, node_rank=1)
    two.register()
    one.register()
    assert list(two.wait_for_all(time.monotonic() + 1, log).ranks) == [2, 3]
    with pytest.raises(RendezvousError, match="--node_rank 1 is already taken"):
        _connect(port, log, worker_num=4, local_worker_num=2, node_rank=1)


def test_too_many_workers_are_refused(log: SchedulerLog) -> None:
    port = _free_port()
    host = _connect(port, log, worker_num=2, local_worker_num=1)
    other = _connect(port, log, worker_num=2, local_worker_num=1)
    extra = _connect(port, log, worker_num=2, local_worker_num=1)
    host.register()
    other.register()
    with pytest.raises(RendezvousError, match="has 2 of its 2 workers"):
        extra.register()
    assert host.wait_for_all(time.monotonic() + 1, log).num_nodes == 2


def test_a_refused_launcher_frees_its_node_rank(
    log: SchedulerLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refused launcher's --node_rank is free again for the right one."""
    monkeypatch.setattr(rendezvous, "REGISTER_RETRY_S", 0.01)
    port = _free_port()
    host = _connect(port, log, worker_num=3, local_worker_num=2, node_rank=0)
    wrong = _connect(port, log, worker_num=3, local_worker_num=2, node_rank=1)
    host.register()
    with pytest.raises(RendezvousError, match="2 are too many"):
        wrong.register()
    right = _connect(port, log, worker_num=3, local_worker_num=1, node_rank=1)
    right.register()
    assert list(right.wait_for_all(time.monotonic() + 1, log).ranks) == [2]


def test_a_refused_launcher_is_not_counted(log: SchedulerLog) -> None:
    """A launcher bringing too many workers is refused without being counted: the launcher
    with the right number still joins (every later one was refused, and the job timed out)."""
    port = _free_port()
    host = _connect(port, log, worker_num=3, local_worker_num=2)
    wrong = _connect(port, log, worker_num=3, local_worker_num=2)
    right = _connect(port, log, worker_num=3, local_worker_num=1)
    host.register()
    with pytest.raises(RendezvousError, match=r"has 2 of its 3 workers .* 2 are too many"):
        wrong.register()
    right.register()
    jobs = [r.wait_for_all(time.monotonic() + 1, log) for r in (host, right)]
    assert [list(j.ranks) for j in jobs] == [[0, 1], [2]]


def test_timeout_names_the_missing_launchers(log: SchedulerLog) -> None:
    port = _free_port()
    host = _connect(port, log, timeout=0.3, worker_num=6, local_worker_num=2, node_rank=0)
    host.register()
    with pytest.raises(RendezvousError) as exc:
        host.wait_for_all(time.monotonic() + 0.3, log)
    message = str(exc.value)
    assert "only 2 of 6 workers joined after 0.3 s" in message
    assert "--node_rank 1, 2 (one launcher each)" in message
    assert f"--master_port {port}" in message
    failure = host.failure()  # published, so that the other launchers stop waiting too
    assert failure is not None and failure.reason == message


def test_gaps_in_explicit_node_ranks(log: SchedulerLog) -> None:
    port = _free_port()
    host = _connect(port, log, worker_num=4, local_worker_num=2, node_rank=0)
    other = _connect(port, log, worker_num=4, local_worker_num=2, node_rank=2)
    host.register()
    other.register()
    with pytest.raises(RendezvousError, match="without gaps"):
        host.wait_for_all(time.monotonic() + 1, log)


def test_first_failure_wins_and_liveness(log: SchedulerLog) -> None:
    port = _free_port()
    host = _connect(port, log, worker_num=2, local_worker_num=1)
    other = _connect(port, log, worker_num=2, local_worker_num=1)
    host.register()
    other.register()
    host.wait_for_all(time.monotonic() + 1, log)
    assert host.failure() is None
    first = RootCause("rank 1 failed first", 1, "b", rank=1)
    assert other.publish_failure(first) == first
    assert host.publish_failure(RootCause("later", 0, "a")) == first
    assert host.failure() == first
    other.mark_finished()
    assert host.finished_count() == 1


def test_heartbeats_tell_a_lost_launcher_from_a_live_or_finished_one(log: SchedulerLog) -> None:
    port = _free_port()
    rdvs = [_connect(port, log, worker_num=3, local_worker_num=1) for _ in range(3)]
    for rdv in rdvs:
        rdv.register()
    for rdv in rdvs:
        rdv.wait_for_all(time.monotonic() + 2, log)
        rdv.start_heartbeat()
    host, quiet, done = rdvs
    assert host.hb is not None and quiet.hb is not None and done.hb is not None
    assert [p.node_rank for p in host.peers()] == [1, 2]
    since = time.monotonic()
    assert host.hb.settle(since, after_s=1.0) == []  # both beat again: alive
    assert time.monotonic() - since < 1.5
    done.mark_finished()
    done.hb.stop()
    quiet.hb.stop()  # stops beating without finishing: lost
    lost = host.hb.settle(time.monotonic(), after_s=1.0)
    assert [(p.node_rank, p.pid) for p in lost] == [(1, os.getpid())]
    assert host.hb.lost(after_s=60.0) == []
    cause = lost_cause(lost, 0, "hostA", after_s=1.0)
    assert cause.reason.startswith("node 1 (host ") and "stopped sending heartbeats" in cause.reason
    host.hb.stop()


def test_must_host_errors_are_clear(log: SchedulerLog) -> None:
    port = _free_port()
    first = _connect(port, log, worker_num=2, local_worker_num=2)
    assert first.hosting
    with pytest.raises(RendezvousError, match=f"port {port} is in use"):
        _connect(port, log, worker_num=2, local_worker_num=2)
    with pytest.raises(RendezvousError, match="not an address of this machine"):
        _connect(port, log, worker_num=2, local_worker_num=2, master_addr="192.0.2.1")
    assert probe_bind("127.0.0.1", port) != 0


def test_client_without_host_times_out_or_stops(log: SchedulerLog) -> None:
    port = _free_port()
    cfg = LaunchConfig("x.py", worker_num=2, local_worker_num=1, node_rank=1, master_port=port)
    with pytest.raises(RendezvousError, match="could not reach the rendezvous store"):
        Rendezvous.connect(cfg, log, time.monotonic() + 0.3, lambda: None)
    with pytest.raises(LauncherInterrupted) as exc:
        Rendezvous.connect(cfg, log, time.monotonic() + 5, lambda: 2)
    assert exc.value.exit_code == 130


def test_launchers_of_another_worker_num_are_refused(log: SchedulerLog) -> None:
    """Node 1 started with --worker_num 3 against node 0's 4 counted node 0's 2 workers and its
    own 1, started rank 2 of a 3-rank job, then blamed node 0 as lost; the client is now refused
    at once, naming both counts, and the host gives up with the same reason."""
    port = _free_port()
    host = _connect(port, log, worker_num=4, local_worker_num=2, node_rank=0)
    with pytest.raises(RendezvousError, match=r"--worker_num differs .*: 4 where the store is "):
        _connect(port, log, worker_num=3, local_worker_num=1, node_rank=1)
    host.register()
    with pytest.raises(RendezvousError, match=r"another launcher gave up: --worker_num differs"):
        host.wait_for_all(time.monotonic() + 5, log)


def test_a_port_that_is_no_store_times_out_or_stops(log: SchedulerLog) -> None:
    """A program listening on --master_port that never answers as a store: torch's client
    waits for ever inside C++ (past --cluster_time_out, deaf to Ctrl-C); it now gives up at
    the deadline with the reason, or stops on a signal."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        cfg = LaunchConfig("x.py", worker_num=2, local_worker_num=1, node_rank=1, master_port=port)
        started = time.monotonic()
        with pytest.raises(RendezvousError, match="accepts connections but did not answer as a"):
            Rendezvous.connect(cfg, log, time.monotonic() + 1.0, lambda: None)
        with pytest.raises(LauncherInterrupted) as exc:
            Rendezvous.connect(cfg, log, time.monotonic() + 30, lambda: 2)
        assert exc.value.exit_code == 130
        assert time.monotonic() - started < 10
