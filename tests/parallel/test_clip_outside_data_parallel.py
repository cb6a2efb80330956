"""torch's gradient clipping in the user's loop under ``parallel_mode="data_parallel"``.

The data-parallel mode averages the gradients at the optimizer step (a step pre-hook), so
between ``loss.backward()`` and ``optimizer.step()`` each rank holds its own. torch's
``clip_grad_norm_`` there (as DDP users write it, the module form) clipped each rank by its own
gradients' norm (0.773 / 0.650 / 0.523 / 0.751 where one device has 0.2685; the parameters
1e-3 off one device's after one step), silently; inside a wrapped step the same call was
already refused. Now ``clip_grad_norm_``, ``clip_grad_value_`` and ``get_total_norm`` over
gradients no step has averaged yet are refused with the same fix (a ValueError naming the
parameter), changing nothing; after the step, whose averaged gradients every rank holds, a
norm taken by torch is one device's.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

from .test_clip_outside_without_hsdp import DATA, MLP

REFUSED = (
    r"torch.nn.utils.{what} outside the wrapped call under parallel_mode='data_parallel': "
    r"parameter 'l1.weight''s gradient is this rank's own until the optimizer step .*"
    r"use parallel_mode='semi_auto'"
)


def test_clipping_before_the_step_is_refused_and_after_it_is_one_devices() -> None:
    x, y = DATA
    ref = MLP()
    ref(x, y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    net = MLP()
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        parallel = sw.AutoParallel(net, parallel_mode="data_parallel")
        parallel(world.rows(x), world.rows(y)).backward()
        before = [p.grad.clone() for p in net.parameters()]
        for what, clip in (
            ("clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)),
            ("clip_grad_value_", lambda: torch.nn.utils.clip_grad_value_(net.parameters(), 0.01)),
            (
                "get_total_norm",
                lambda: torch.nn.utils.get_total_norm([p.grad for p in net.parameters()]),
            ),
        ):
            with pytest.raises(ValueError, match=REFUSED.format(what=what)):
                clip()
        for p, grad in zip(net.parameters(), before, strict=True):
            assert torch.equal(p.grad, grad)
        opt.step()  # (averages the gradients, then updates as one device)
        for name, p in net.named_parameters():
            assert_matches_single_device(p.detach(), ref.get_parameter(name), what=name)
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9)
        assert_matches_single_device(norm, want, what="the norm after the step")
