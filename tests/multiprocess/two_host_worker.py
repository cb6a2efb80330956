"""Worker for test_two_hosts_real.py. Usage: two_host_worker.py check OUT_DIR | loop MARKER PID_DIR

- ``check``: joins with `init()` (no GLOO_SOCKET_IFNAME set by the test), prints the socket
  interface it got, trains 3 manual-data-parallel steps (each rank its rows of every global
  batch of 32) and writes ``OUT_DIR/rank_<r>.json`` (losses, final parameters); then checks
  every collective against single-process math (`real_collectives_worker.main`).
- ``loop``: joins, starts a child process carrying ``MARKER-node<node rank>`` (for the orphan
  check), writes the
  pids to PID_DIR, prints ``rank R ready`` and all-reduces every 0.3 s until stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init

sys.path.insert(0, str(Path(__file__).parent))
from manual_dp_common import GLOBAL_BATCH, ReduceLoss, make_network, make_samples
from real_collectives_worker import main as check_collectives

STEPS = 3


def train(out: Path) -> None:
    rank, n = get_rank(), get_group_size()
    sw.set_seed(5)
    net = make_network()
    samples = make_samples()
    opt = torch.optim.SGD(net.parameters(), 1e-2, momentum=0.9)
    reducer = sw.nn.DistributedGradReducer(net.parameters())
    loss_fn = ReduceLoss()
    rows = GLOBAL_BATCH // n
    losses = []
    for step in range(STEPS):
        mine = samples[step * GLOBAL_BATCH + rank * rows : step * GLOBAL_BATCH + (rank + 1) * rows]
        images = torch.stack([s[0] for s in mine])
        labels = torch.stack([s[1] for s in mine])
        opt.zero_grad()
        loss = loss_fn(net(images), labels)
        loss.backward()
        reducer()
        opt.step()
        losses.append(float(loss))
    params = {k: v.tolist() for k, v in net.state_dict().items()}
    (out / f"rank_{rank}.json").write_text(json.dumps({"losses": losses, "params": params}))


def loop(marker: str, pid_dir: Path) -> None:
    rank = get_rank()
    node_marker = f"{marker}-node{os.environ.get('GROUP_RANK')}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", node_marker])
    (pid_dir / f"{rank}.pids").write_text(f"{os.getpid()} {child.pid}\n")
    print(f"rank {rank} ready", flush=True)
    t = torch.ones(1)
    while True:
        sw.ops.AllReduce()(t)
        time.sleep(0.3)


def main() -> None:
    init()
    print(f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
    if sys.argv[1] == "check":
        train(Path(sys.argv[2]))
        check_collectives()
    else:
        loop(sys.argv[2], Path(sys.argv[3]))


if __name__ == "__main__":
    main()
