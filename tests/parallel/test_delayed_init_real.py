"""Delayed init under `AutoParallel` on 8 real gloo processes (`shardwise run`).

Each process builds seed 003's initializer network (Layout version) and its SGD optimizer inside
``sw.no_init_parameters()``; AutoParallel's first call materializes this rank's blocks in place
(the optimizer's Parameter objects are the module's). Every process also runs the eager
single-device network itself (same seed) and checks its blocks before the first step, the 3
losses and its blocks and gradients after each backward (1e-5 relative).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_job

WORKER = """
import sys
sys.path.insert(0, {here!r})
import torch
import torch.nn.functional as F
import shardwise as sw
from shardwise.communication import get_group_size, get_rank
from shardwise.parallel import AutoParallel
from test_delayed_init_parity import BATCH, LR, SEED, Network, data, single_device


def close(got, want, what):
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        diff = (got - want).abs().max().item()
        raise AssertionError(f"rank {{get_rank()}}: {{what}} differs (max abs diff {{diff}})")


def check(net, plan, state, rank, grads):
    for name, p in net.named_parameters():
        index = plan.params[name].layout.local_slice(rank, state[name].shape)
        close(p.detach(), state[name][index], name)
        if grads:
            close(p.grad, state[name + ".grad"][index], name + ".grad")


sw.communication.init()
rank, n = get_rank(), get_group_size()
initial, losses, states = single_device(layouts=True)
torch.manual_seed(SEED)
with sw.no_init_parameters():
    net = Network(layouts=True)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
assert all(sw.parameter.is_deferred(p) for p in net.parameters())
rows = BATCH // n
batches = data()
parallel = AutoParallel(net)
plan = parallel.plan(batches[0][0][rank * rows : (rank + 1) * rows])
held = opt.param_groups[0]["params"]
assert all(a is b for a, b in zip(held, net.parameters(), strict=True)), "optimizer objects"
check(net, plan, initial, rank, grads=False)
print("CHECK step 0 init OK", flush=True)
for step, (x, y) in enumerate(batches):
    mine = slice(rank * rows, (rank + 1) * rows)
    loss = sw.ops.AllReduce()(F.cross_entropy(parallel(x[mine]), y[mine])) / n
    loss.backward()
    close(loss.detach(), torch.tensor(losses[step]), f"loss {{step}}")
    check(net, plan, states[step], rank, grads=True)
    opt.step()
    opt.zero_grad()
    print(f"CHECK step {{step}} OK", flush=True)
sw.communication.release()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_delayed_init_on_eight_real_processes(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER.format(here=str(Path(__file__).parent)))
    res = run_job(worker, 8, tmp_path / "logs", timeout=150)
    logs = [res.worker_log(r) for r in range(8)]
    assert res.returncode == 0, res.output + "".join(logs)
    for rank, log in enumerate(logs):
        assert "CHECK step 0 init OK" in log, f"rank {rank}:\n{log}"
        for step in range(3):
            assert f"CHECK step {step} OK" in log, f"rank {rank}, step {step}:\n{log}"
