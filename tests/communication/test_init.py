"""init() in a plain single process: a 1-rank job whose collectives are identities; the exit
barrier; and (from the 2-process job's groups_worker.py) create_group and a second init()."""

from __future__ import annotations

import contextlib
import datetime
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.communication import get_group_size, get_local_rank, get_rank, init, release
from shardwise.testing import JobResult, clean_env


def test_init_plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "RANK_TABLE_FILE"):
        monkeypatch.delenv(name, raising=False)
    init()
    init()  # idempotent
    try:
        assert (get_rank(), get_group_size(), get_local_rank()) == (0, 1, 0)
        x = torch.arange(4.0, requires_grad=True)
        with sw.CommRecorder() as rec:
            y = sw.ops.AllReduce()(x)
            assert torch.equal(sw.ops.AllGather()(x), x)
            assert torch.equal(sw.ops.ReduceScatter()(x), x)
            (b,) = sw.ops.Broadcast(0)(x)
            y.sum().backward()
        assert torch.equal(y, x) and torch.equal(b, x)
        assert torch.equal(x.grad, torch.ones(4))
        assert rec.total_bytes() == 0
        sw.communication.create_group("solo", [0])
        assert get_rank("solo") == 0
    finally:
        release()
    assert not sw.communication.is_initialized()


def test_calls_before_init_explain() -> None:
    """Named by what the user called (it named an internal function, resolve_group)."""
    import shardwise as sw

    for call in (get_rank, lambda: sw.ops.AllReduce()(torch.ones(2))):
        with pytest.raises(RuntimeError, match=r"get_rank\(\).*: no job yet; call shardwise"):
            call()


def test_a_bad_comm_timeout_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """It was a bare "could not convert string to float: 'abc'" in every worker."""
    from shardwise.communication import comm_timeout

    monkeypatch.setenv("SHARDWISE_COMM_TIMEOUT", "abc")
    with pytest.raises(ValueError, match=r"SHARDWISE_COMM_TIMEOUT='abc': expected a number of sec"):
        comm_timeout()
    monkeypatch.setenv("SHARDWISE_COMM_TIMEOUT", "7.5")
    assert comm_timeout() == datetime.timedelta(seconds=7.5)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="backend='tpu'"):
        init("tpu")
    with pytest.raises(ValueError, match="expected 'gloo', 'nccl', 'mpi' or None"):
        init("hccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_nccl_without_cuda_says_so() -> None:
    """A MindSpore GPU script's init("nccl") on a CPU-only torch failed inside torch with
    AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'."""
    with pytest.raises(ValueError, match="'nccl' needs CUDA, which this torch/machine lacks"):
        init("nccl")
    assert not sw.communication.is_initialized()


def test_nccl_on_a_torch_without_nccl_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA present but torch built without NCCL: the error said 'nccl' needs CUDA."""
    import torch.distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is available but this torch was built without NCCL"):
        init("nccl")
    assert not sw.communication.is_initialized()
    assert sw.communication.default_backend() == "gloo"


class _Store:
    """A rendezvous store shared by threads (add / set / wait), logging who did what."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.log: list[tuple[int, str]] = []
        self.cond = threading.Condition()

    def add(self, key: str, n: int) -> int:
        with self.cond:
            self.values[key] = self.values.get(key, 0) + n
            self.log.append((_rank.value, f"add {key}"))
            self.cond.notify_all()
            return self.values[key]

    def set(self, key: str, value: str) -> None:
        self.add(key, 1)

    def check(self, keys: list[str]) -> bool:
        with self.cond:
            self.log.append((_rank.value, f"check {keys}"))
            return all(k in self.values for k in keys)

    def wait(self, keys: list[str], timeout: object) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: all(k in self.values for k in keys), 10)


_rank = threading.local()


def test_release_barrier_keeps_the_store_host_until_every_rank_left() -> None:
    """Rank 0 hosts the rendezvous store: its `_store_barrier` returns only after every rank
    has stopped using the store, else a rank still waiting loses its connection."""
    from shardwise.communication._store_sync import store_barrier

    store, world = _Store(), 3
    returned: list[tuple[int, int]] = []

    def rank(r: int) -> None:
        _rank.value = r
        if r == world - 1:
            time.sleep(0.2)  # the last to arrive: the others are already waiting
        store_barrier(store, "release/1", r, world)
        with store.cond:
            returned.append((r, len(store.log)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    last_use = max(i for i, (r, _) in enumerate(store.log) if r != 0) + 1
    host_return = dict(returned)[0]
    assert len(returned) == world and host_return >= last_use


def test_a_rank_that_gave_up_on_the_exit_barrier_is_not_waited_for_again() -> None:
    """Rank 1 left at once and gave up waiting (its exit wait is short); rank 0 came late: it
    finds everyone gone and returns at once, instead of waiting its own timeout for rank 1."""
    from shardwise.communication._store_sync import store_barrier

    store, ended = _Store(), {}

    def rank(r: int, late: float, timeout: float) -> None:
        _rank.value = r
        time.sleep(late)
        start = time.monotonic()
        with contextlib.suppress(RuntimeError):
            store_barrier(store, "exit/1", r, 2, datetime.timedelta(seconds=timeout))
        ended[r] = time.monotonic() - start

    threads = [threading.Thread(target=rank, args=a) for a in ((0, 0.5, 5.0), (1, 0.0, 0.2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert ended[1] < 0.5  # (gave up)
    assert ended[0] < 1.0  # (not the 5 s of its timeout)


def test_a_release_barrier_timing_out_names_the_ranks_that_did_not_arrive() -> None:
    """Rank 0 still working (an evaluation on rank 0 alone) past the timeout: rank 1's
    release() named only a store key ("store barrier: shardwise/release/1/done not set"), and
    the launcher's report blamed rank 1."""
    from shardwise.communication._store_sync import store_barrier

    _rank.value = 1
    with pytest.raises(RuntimeError, match=r"rank 0 did not reach release\(\) within 0\.2 s"):
        store_barrier(_Store(), "release/1", 1, 2, datetime.timedelta(seconds=0.2))


def _exit_script(tmp_path: Path, name: str, ending: str) -> subprocess.Popen[str]:
    """A 1-rank script under init() that ends with `ending`; it prints whether it was still
    initialized after shardwise's exit hook (which leaves the job only after a normal end)."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        "import atexit, sys, threading\n"
        "from shardwise import communication as comm\n"
        "atexit.register(lambda: print('joined at exit:', comm.is_initialized(), flush=True))\n"
        "comm.init('gloo')\n" + ending
    )
    return subprocess.Popen(
        [sys.executable, str(script)], env=clean_env(), text=True, stdout=subprocess.PIPE
    )


def test_sys_exit_with_a_failure_leaves_at_once_and_a_threads_does_not(tmp_path: Path) -> None:
    """``sys.exit(3)`` leaves at once, without the exit barrier, as a raise does; ``sys.exit(1)``
    in a worker thread (which ends only that thread) made the normal end that followed skip
    the exit barrier, as a failure."""
    endings = {
        "main": "sys.exit(3)\n",
        "thread": "t = threading.Thread(target=sys.exit, args=(1,))\nt.start()\nt.join()\n",
    }
    procs = {name: _exit_script(tmp_path, name, ending) for name, ending in endings.items()}
    outs = {name: p.communicate(timeout=60)[0] for name, p in procs.items()}
    assert (procs["main"].returncode, outs["main"]) == (3, "joined at exit: True\n")
    assert (procs["thread"].returncode, outs["thread"]) == (0, "joined at exit: False\n")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_groups_and_a_second_init_on_two_real_processes(two_rank_job: JobResult) -> None:
    """tests/multiprocess/groups_worker.py: a group whose members made different numbers of
    groups before it is refused at once on both, naming it and the fix (both waited for the
    whole timeout, failing on a store key); `init()` after `release()` joins cleanly (its world
    group read the first one's addresses: refused connections, resets, hangs)."""
    two_rank_job.assert_checks(2, ["uneven_groups_refused", "init_again_after_release"])
