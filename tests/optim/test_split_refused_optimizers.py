"""``torch.optim.LBFGS`` / ``torch.optim.Adafactor`` over parameters split at operator level.

Without hsdp a column-parallel ``nn.Linear`` (``sw.shard(l, ((1, 1), (2, 1)))``) stores this
rank's block of its weight: LBFGS's norms and ``float()``s and Adafactor's per-parameter RMS
and row / column statistics were taken from the block (a real 2-process job trained silently
wrong: Adafactor's weights 8.9e-4 off one device's, LBFGS's third loss 3.927 against 3.255; a
simulated world raised only its generic "a tensor whose value differs between the ranks"
error). Now the step is refused with a ValueError naming the optimizer, the split parameters
and the fix, before any update, in the train-step form and the module form (LBFGS's first
call inside its closure, Adafactor's step after the user's backward). Replicated parameters
(plain data parallel) still train as on one device (`test_hsdp_refused_optimizers`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

from .test_hsdp_refused_optimizers import DATA, adafactor, build, lbfgs, make_step, plain_step

MAKERS = {"lbfgs": lbfgs, "adafactor": adafactor}


def refused(optimizer: str) -> str:
    kind = "LBFGS" if optimizer == "lbfgs" else "Adafactor"
    return (
        rf"torch.optim.{kind} steps over parameter\(s\) '0.weight', '0.bias', which the plan "
        r"stores split at operator level.*its own block.*no sw.shard"
    )


def column_parallel() -> nn.Module:
    net = build()
    sw.shard(net[0], in_strategy=((1, 1), (2, 1)))  # (its weight and bias: rows over 2 ranks)
    return net


@pytest.mark.parametrize("form", ["step", "module"])
@pytest.mark.parametrize("optimizer", ["lbfgs", "adafactor"])
def test_a_step_over_split_parameters_is_refused(optimizer: str, form: str) -> None:
    net, ref = column_parallel(), build()
    x, y = DATA[0]
    with simulated_world(2) as world:
        world.replicate(net)
        opt = MAKERS[optimizer](net)
        with pytest.raises(ValueError, match=refused(optimizer)):
            if form == "step":
                stepper = make_step if optimizer == "lbfgs" else plain_step
                sw.AutoParallel(stepper(net, opt), parallel_mode="semi_auto")(
                    world.rows(x), world.rows(y)
                )
            else:
                parallel = sw.AutoParallel(net, parallel_mode="semi_auto")

                def closure() -> torch.Tensor:
                    opt.zero_grad()
                    loss = F.cross_entropy(parallel(world.rows(x)), world.rows(y))
                    loss.backward()
                    return loss

                if optimizer == "lbfgs":  # (the wrapper's first call inside the step)
                    opt.step(closure)
                else:
                    closure()
                    opt.step()
        for name, p in net.named_parameters():  # (no update ran; a split one: its block)
            full = ref.get_parameter(name).detach()
            want = full if p.shape == full.shape else (lambda r, f=full: f.chunk(2)[r])
            assert_matches_single_device(p.detach(), want, what=name)
