"""`report.MemoryMeter`: the bytes torch's CPU allocator holds, from profiler memory events."""

from __future__ import annotations

import pytest
import torch

from shardwise.report import MemoryMeter

WEIGHT = 1024 * 1024 * 4  # a Linear(1024, 1024)'s weight, float32


def test_a_step_holds_weights_gradients_state_and_temporaries() -> None:
    with MemoryMeter() as meter:
        net = torch.nn.Linear(1024, 1024)
        opt = torch.optim.AdamW(net.parameters())
        for i in range(2):
            with meter.window(f"step {i}"):
                net(torch.ones(8, 1024)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert meter.held_at("step 0") == pytest.approx(WEIGHT, rel=0.01)  # the weight (and bias)
    assert meter.held_at("step 1") == pytest.approx(3 * WEIGHT, rel=0.01)  # + AdamW's state
    # weight, gradient, two states and the update's two temporaries
    assert meter.peak("step 1") == pytest.approx(6 * WEIGHT, rel=0.01)
    assert meter.peak() >= meter.peak("step 1")


def test_memory_allocated_before_the_meter_is_not_counted() -> None:
    before = torch.ones(WEIGHT // 4)
    with MemoryMeter() as meter, meter.window("w"):
        del before  # (its free is not counted either)
        kept = torch.ones(1024)
    assert meter.peak("w") == kept.nbytes


def test_errors() -> None:
    meter = MemoryMeter()
    with pytest.raises(RuntimeError, match="only inside"), meter.window("x"):
        pass
    with meter:
        pass
    with pytest.raises(KeyError, match="no window 'step' was measured"):
        meter.peak("step")
    with pytest.raises(RuntimeError, match="a meter runs once"), meter:
        pass
