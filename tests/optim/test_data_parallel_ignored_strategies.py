"""``parallel_mode="data_parallel"`` and annotated ops: a warning naming them, once.

That mode runs the whole network on every rank, so a primitive's ``shard()`` strategy and
``sw.shard``'s op form change nothing, and were accepted silently, even one that fits no job
(``MatMul().shard(((3, 1), (1, 1)))`` on 8 ranks, which semi_auto refuses). Now the wrapper's
first call warns (UserWarning, at the user's call) naming each annotated op by module path and
suggesting semi_auto; later calls and networks without annotations stay silent. The run itself
is unchanged: the loss is one device's.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(1)
X = torch.randn(16, 32, generator=g)


class Net(nn.Module):
    def __init__(self, annotate: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(32, 16) * 0.2)
        self.mm = sw.ops.MatMul()
        self.fc = nn.Linear(16, 4)
        if annotate:
            self.mm.shard(((3, 1), (1, 1)))  # (3 divides neither 8 nor 16)
            sw.shard(self.fc, in_strategy=((2, 1), (4, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.mm(x, self.w))
        return out


def run(annotate: bool) -> list[list[str]]:
    """The warnings of each of two data_parallel calls (8 ranks, full batch), checking the loss
    against one device's."""
    ref = Net(annotate=False)
    want = ref(X).square().mean()
    net = Net(annotate)
    said = []
    with simulated_world(8) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = net(x).square().mean()
            loss.backward()
            return loss

        wrapped = sw.AutoParallel(step, parallel_mode="data_parallel")
        wrapped.dataset_strategy("full_batch")
        for _ in range(2):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                loss = wrapped(world.same(X))
            assert_matches_single_device(loss, want.detach(), what="loss")
            said.append(
                [f"{w.filename}: {w.message}" for w in seen if "data_parallel" in str(w.message)]
            )
    return said


def test_annotated_ops_are_named_once_at_the_first_call() -> None:
    first, second = run(annotate=True)
    assert len(first) == 1 and not second, (first, second)
    assert first[0].startswith(__file__), first  # (at the user's call)
    assert (
        "AutoParallel: parallel_mode='data_parallel' runs the whole network on every rank and "
        "ignores the strategies set on mm (MatMul), fc (Linear, sw.shard's op form) "
        "(not even checked against the job); use parallel_mode='semi_auto' to run them as "
        "annotated, or drop the annotations" in first[0]
    ), first


def test_a_network_without_annotations_is_not_warned_about() -> None:
    assert run(annotate=False) == [[], []]
