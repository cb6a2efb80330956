"""examples/fusion_example.py (seed 001): the tutorial's 12 lines exactly, and the collectives
its fusion ids give under hsdp on 8 simulated ranks (id 0: one AllGather and one ReduceScatter
per parameter; ids 1 and 2: one of each per layer), with single-device losses."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

EXAMPLE = Path(__file__).parents[2] / "examples" / "fusion_example.py"
SEED_LINES = """\
The parameter layer1.input_mapping.weight's fusion id is 0
The parameter layer1.input_mapping.bias's fusion id is 0
The parameter layer1.output_mapping.weight's fusion id is 0
The parameter layer1.output_mapping.bias's fusion id is 0
The parameter layer2.input_mapping.weight's fusion id is 1
The parameter layer2.input_mapping.bias's fusion id is 1
The parameter layer2.output_mapping.weight's fusion id is 1
The parameter layer2.output_mapping.bias's fusion id is 1
The parameter layer3.input_mapping.weight's fusion id is 2
The parameter layer3.input_mapping.bias's fusion id is 2
The parameter layer3.output_mapping.weight's fusion id is 2
The parameter layer3.output_mapping.bias's fusion id is 2
"""
STEPS = 3


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fusion_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_print_only_gives_the_tutorial_lines() -> None:
    res = subprocess.run(
        [sys.executable, str(EXAMPLE), "--print-only"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout == SEED_LINES


def test_fusion_lines_in_process() -> None:
    assert example().fusion_lines(example().Net()) == SEED_LINES.splitlines()


def single_device(ex: ModuleType, net: torch.nn.Module) -> list[float]:
    opt = torch.optim.SGD(net.parameters(), 1e-2)
    losses = []
    for x, y in ex.batches(16, STEPS):
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_collectives_per_fusion_group_on_8_ranks(level: str) -> None:
    ex = example()
    sw.set_seed(1)
    net = ex.Net(16)  # built outside the world: inside, each rank would draw its own values
    want = single_device(ex, copy.deepcopy(net))
    data = ex.batches(16, STEPS)  # made outside the world too
    reduce_phase = "step" if level == "level1" else "backward"  # level2/3: during backward
    with simulated_world(8) as world:
        world.replicate(net)
        parallel_net = ex.parallel_step(net, level)
        for step, (x, y) in enumerate(data):
            with CommRecorder() as rec:
                loss = parallel_net(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, torch.tensor(want[step]), what=f"loss {step}")
            # 4 per-parameter collectives for layer1 (id 0), one fused each for layers 2 and 3
            assert rec.count("AllGather", "forward") == 6, rec.summary()
            assert rec.count("ReduceScatter", reduce_phase) == 6, rec.summary()
            # level3 gathers again in backward what backward reads: layer1.output_mapping.weight
            # (id 0; layer1.input_mapping's input needs no gradient) and the buckets of ids 1, 2
            assert rec.count("AllGather", "backward") == (3 if level == "level3" else 0)
            # the loss's forward; its backward needs none (loss.backward(): the seed is ones on
            # every rank)
            assert rec.count("AllReduce") == 1, rec.summary()
            assert rec.count() == 13 + rec.count("AllGather", "backward"), rec.summary()
    plan = parallel_net.optimizer_plan
    assert plan is not None
    assert all(p.shard == 8 for p in plan.params)
    buckets = [(b.kind, b.fusion, len(b.names)) for b in plan.buckets]
    assert buckets == [("shard", 0, 1)] * 4 + [("shard", 1, 4), ("shard", 2, 4)]
