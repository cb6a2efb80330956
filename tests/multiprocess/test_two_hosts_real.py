"""`shardwise run` across two hosts joined by a real network link (network namespaces and a
veth pair, see netns.py), 2 workers on each: nobody sets GLOO_SOCKET_IFNAME, yet the job's
collectives and a 3-step training run equal the single-host results (and `init()` picks the
interface under torchrun's variables too); killing one host's
launcher stops the other host's workers within 10 s and names the lost node first.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.testing import clean_env

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from manual_dp_common import GLOBAL_BATCH, make_network, make_samples  # noqa: E402
from netns import Host, skip_reason, two_hosts  # noqa: E402
from test_collectives_real import CHECKS  # noqa: E402
from test_launcher import _state, survivors, wait_for  # noqa: E402

WORKER = HERE / "two_host_worker.py"
PORT = "29400"  # each host has its own network stack: no other job can hold it there

SKIP = skip_reason()
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(SKIP is not None, reason=str(SKIP))]


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    with two_hosts() as pair:
        yield pair


def start(hosts: tuple[Host, Host], node: int, logs: Path, *script: str) -> subprocess.Popen[str]:
    """Host `node`'s launcher: 4 workers in all, 2 here, store on host 0's veth address."""
    cmd = [
        sys.executable, "-m", "shardwise", "run", "--worker_num", "4", "--local_worker_num", "2",
        "--master_addr", hosts[0].addr, "--master_port", PORT, "--node_rank", str(node),
        "--log_dir", str(logs / f"node{node}"), "--join", "True", "--cluster_time_out", "60",
        str(WORKER), *script,
    ]  # fmt: skip
    env = {k: v for k, v in clean_env().items() if not k.endswith("_SOCKET_IFNAME")}
    return subprocess.Popen(
        hosts[node].command(cmd), env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def single_device() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The 3 steps on one device, on the same global batches."""
    sw.set_seed(5)
    net = make_network()
    samples = make_samples()
    opt = torch.optim.SGD(net.parameters(), 1e-2, momentum=0.9)
    losses = []
    for step in range(3):
        batch = samples[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            net(torch.stack([s[0] for s in batch])), torch.stack([s[1] for s in batch])
        )
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, net.state_dict()


@pytest.mark.timeout(150)
def test_two_hosts_train_and_communicate_like_one(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    started = time.monotonic()
    procs = [start(hosts, node, tmp_path, "check", str(tmp_path)) for node in (1, 0)]
    try:
        outputs = [p.communicate(timeout=130) for p in procs]
    finally:
        for p in procs:
            p.kill()
    print(f"two-host job: {time.monotonic() - started:.1f} s")
    logs = [(tmp_path / f"node{r // 2}" / f"worker_{r}.log").read_text() for r in range(4)]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out + err + "".join(logs)
    for rank, log in enumerate(logs):
        assert f"GLOO_SOCKET_IFNAME={hosts[rank // 2].ifname}\n" in log, log
        for name in CHECKS:
            assert f"CHECK {name} OK" in log, f"rank {rank} did not pass {name}:\n{log}"
    for node in (0, 1):
        scheduler = (tmp_path / f"node{node}" / "scheduler.log").read_text()
        assert f"workers get GLOO_SOCKET_IFNAME={hosts[node].ifname}" in scheduler
    want_losses, want_params = single_device()
    for rank in range(4):
        got = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=1e-5, atol=1e-6
        )
        for name, value in want_params.items():
            torch.testing.assert_close(
                torch.tensor(got["params"][name]), value, rtol=1e-5, atol=1e-6
            )


@pytest.mark.timeout(90)
def test_init_picks_the_interface_under_other_launchers(
    hosts: tuple[Host, Host], tmp_path: Path
) -> None:
    """torchrun's variables, no `shardwise run`: `init()` itself picks each host's interface."""
    base = {k: v for k, v in clean_env().items() if not k.endswith("_SOCKET_IFNAME")}
    port, procs = PORT, []
    for rank in range(4):
        env = {
            **base, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2),
            "MASTER_ADDR": hosts[0].addr, "MASTER_PORT": port,
        }  # fmt: skip
        cmd = hosts[rank // 2].command([sys.executable, str(HERE / "workers" / "allreduce.py")])
        procs.append(
            subprocess.Popen(
                cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    try:
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, out
        assert f"rank {rank} of 4 (local {rank % 2}) sum 6" in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [1, 0], ids=["sigkill-node1", "sigkill-node0"])
def test_a_killed_launcher_is_named_and_the_other_host_stops(
    hosts: tuple[Host, Host], tmp_path: Path, victim: int
) -> None:
    """SIGKILL to one host's launcher (node 1; or node 0, which hosts the store): the other
    host's workers are gone and its report names the lost node first, within 10 s."""
    first = rf"job failed: node {victim} \(host .*\) lost: its launcher \(pid \d+\) stopped"
    marker, survivor = f"swtest-{tmp_path.name}-lost", 1 - victim
    procs = {node: start(hosts, node, tmp_path, "loop", marker, str(tmp_path)) for node in (1, 0)}
    try:
        for rank in range(4):
            wait_for(tmp_path / f"node{rank // 2}" / f"worker_{rank}.log", "ready", 60)
        killed = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        _, err = procs[survivor].communicate(timeout=30)
        took = time.monotonic() - killed
    finally:
        for p in procs.values():
            p.kill()
        for pid in survivors(f"{marker}-node{victim}"):  # a SIGKILLed launcher cannot sweep
            os.kill(pid, signal.SIGKILL)
    print(f"SIGKILL to node {victim}: node {survivor} ended after {took:.1f} s")
    assert procs[survivor].returncode == 1, err
    report = err[err.index("shardwise run: job failed") :]
    assert re.match(rf"shardwise run: {first}", report), err
    scheduler = (tmp_path / f"node{survivor}" / "scheduler.log").read_text()
    assert re.search(first, scheduler), scheduler
    assert took < 10, f"node {survivor} took {took:.1f} s to stop its workers and report"
    for rank in (2 * survivor, 2 * survivor + 1):  # its workers and their children are gone
        for pid in (tmp_path / f"{rank}.pids").read_text().split():
            assert _state(int(pid)) in ("Z", "X", "gone"), f"rank {rank}'s pid {pid} is alive"
    assert not survivors(f"{marker}-node{survivor}")
