"""In a simulated world, an in-place op that writes each rank's value into a tensor made
outside the world (one plain tensor all ranks share) raises instead of updating it once per
rank; made inside (or given with `world.same`), or written out of place, it is each rank's. An
explicit generator gives every rank one process's draw; seeding inside a wrapped step works. A
tensor whose ranks hold different values, turned into one Python value, raises naming them."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world


def test_in_place_write_into_an_outside_tensor_is_refused() -> None:
    total, ones = torch.zeros(2), torch.ones(4, 2)
    with simulated_world(2) as world:
        part = world.rows(ones).sum(0)  # 2.0 on each rank
        with pytest.raises(
            ValueError, match=r"aten\.add_\.Tensor .* shape \[2\] that every rank shares"
        ):
            total += part
        assert total.tolist() == [0.0, 0.0]  # (nothing written)
        with pytest.raises(ValueError, match="made outside the world"):
            torch._foreach_add_([total], [part])
        inside = torch.zeros(2)
        inside += part
        total = total + part  # out of place: a per-rank result
        for got in (inside, total):
            assert [t.tolist() for t in world.local_tensors(got)] == [[2.0, 2.0]] * 2


def test_writes_without_per_rank_values_still_run_once() -> None:
    total, step = torch.zeros(2), torch.zeros(())
    with simulated_world(2):
        total += 1.0  # (no per-rank value: one write, as in each process)
        step.add_(1)
    assert total.tolist() == [1.0, 1.0] and step.item() == 1.0


def test_an_explicit_generator_gives_every_rank_the_same_draw() -> None:
    """Each process of a job draws from its own generator seeded alike: every simulated rank
    gets the numbers one process gets (rank 1 got the numbers after rank 0's), and the
    generator stands where one process leaves it."""
    g = torch.Generator().manual_seed(0)
    want, after = torch.rand(3, generator=g).tolist(), torch.rand(2, generator=g).tolist()
    normal = torch.empty(3).normal_(generator=g.manual_seed(1)).tolist()
    with simulated_world(2) as world:
        drawn = torch.rand(3, generator=g.manual_seed(0))
        later = torch.rand(2, generator=g)
        filled = torch.empty(3).normal_(generator=g.manual_seed(1))  # (in place, per rank)
    for got, expect in ((drawn, want), (later, after), (filled, normal)):
        assert [t.tolist() for t in world.local_tensors(got)] == [expect] * 2


def test_seeding_inside_a_wrapped_step_with_dropout() -> None:
    """``torch.manual_seed`` at the top of a train step in a simulated world: LocalTensorMode's
    own seeding copied the generator states with tensor ops, which the plan executor took for
    ops of the step (it stopped, naming torch.Tensor.clone). The losses equal one device's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    state = {k: v.clone() for k, v in net.state_dict().items()}

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(123)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss

    want = step(x, y).detach()
    net.load_state_dict(state)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        for _ in range(2):
            assert_matches_single_device(parallel(world.rows(x), world.rows(y)), want)


def test_a_draw_from_plain_tensors_advances_every_ranks_stream() -> None:
    """A draw on tensors made inside the world but not per rank (a ``Beta`` sample's gammas)
    ran once on the process's generator, so every rank's next draw repeated numbers one
    process had used; now each rank draws from its own stream, as one process does."""
    torch.manual_seed(7)
    beta = torch.distributions.Beta(torch.tensor([0.4]), torch.tensor([0.4]))
    want = [beta.sample().tolist(), torch.rand(2).tolist()]
    with simulated_world(2) as world:
        torch.manual_seed(7)
        inside = torch.distributions.Beta(torch.tensor([0.4]), torch.tensor([0.4]))
        got = [inside.sample(), torch.rand(2)]
        for value, expect in zip(got, want, strict=True):
            assert [t.tolist() for t in world.local_tensors(value)] == [expect] * 2


def test_worlds_leave_the_excepthook_as_they_found_it() -> None:
    """torch wraps ``sys.excepthook`` at each process-group init (a ``[rank0]: `` prefix per
    traceback line); a world or a dry run left it wrapped, once more per world."""
    before = sys.excepthook
    for _ in range(3):
        with simulated_world(2):
            pass
        with sw.communication.dry_run(4, rank=1):
            pass
    assert sys.excepthook is before


def test_one_python_value_from_a_tensor_the_ranks_differ_on() -> None:
    """``.item()``, ``float()`` and an ``if`` on a per-rank tensor: one value where the ranks
    agree (an integer's ``.item()``: torch's per-rank int, each rank's count) (NaN too: torch's
    comparison of the ranks' numbers refused NaN), a ValueError naming the ranks' values and the
    fixes where they differ (torch raised an AssertionError, or for a comparison's ``bool()`` an
    AttributeError on ``guard_int``)."""
    with simulated_world(2) as world:
        same = world.rank_map(lambda r: torch.tensor([float("nan"), 1.5]))
        assert math.isnan(same.sum().item()) and float(same[1]) == 1.5 and bool(same[1] > 1)
        counts = world.rank_map(lambda r: torch.tensor(r + 1))  # (an integer: torch's per-rank int)
        assert_matches_single_device(
            torch.full((2,), counts.item()), lambda r: torch.full((2,), r + 1)
        )
        x = world.rank_map(lambda r: torch.tensor([1.0 + r]))
        for convert in (
            lambda: x.sum().item(),
            lambda: float(x),
            lambda: bool(x.sum() > 1.5),
            lambda: 1 if x.sum() > 1.5 else 0,
        ):
            with pytest.raises(ValueError, match=r"differs between the ranks \(rank 0: .*run_job"):
                convert()


def test_a_network_not_replicated_names_world_replicate() -> None:
    """A network built outside the world and trained without ``world.replicate(net)``: the
    message named factories and out-of-place writes, not the fix; a parameter written (its
    blocks stored by the plan) names world.replicate, and so does a buffer's message."""
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    sw.shard(net[0], in_strategy=((2, 1), (2, 1)))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    bn, rows = nn.BatchNorm1d(3), torch.randn(8, 3)
    with simulated_world(4) as world:
        opt = torch.optim.SGD(net.parameters(), 0.1)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with pytest.raises(ValueError, match=r"into a parameter .* Call world\.replicate\(net\)"):
            parallel(world.rows(x), world.rows(y))
        with pytest.raises(ValueError, match=r"A network's buffer .* world\.replicate\(net\)"):
            bn.running_mean += world.rows(rows).mean(0)


def test_batch_norm_running_statistics_not_replicated_are_refused() -> None:
    """A BatchNorm built outside the world and run in training mode without
    ``world.replicate(net)``: torch's batch norm op writes its running statistics without its
    schema saying so, and every simulated rank's update went silently into the one shared
    buffer (ending with neither rank's value); now refused naming world.replicate. In eval
    mode the statistics are only read: it runs."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))

    x, net = torch.randn(8, 4), make()
    refused = pytest.raises(ValueError, match=r"native_batch_norm.*world\.replicate\(net\)")
    with simulated_world(2) as world, refused:
        sw.AutoParallel(net, parallel_mode="data_parallel")(world.rows(x))
    mean, var = torch.zeros(4), torch.ones(4)  # (torch.batch_norm_update_stats: also unmarked)
    refused = pytest.raises(ValueError, match=r"batch_norm_update_stats.*world\.replicate")
    with simulated_world(2) as world, refused:
        torch.batch_norm_update_stats(world.rows(x), mean, var, 0.5)
    net = make().eval()
    with simulated_world(2) as world:
        out = sw.AutoParallel(net, parallel_mode="data_parallel")(world.rows(x))
        assert_matches_single_device(out, lambda r: net(x).chunk(2)[r], what="output")


@pytest.mark.parametrize("mode", ["semi_auto", "data_parallel"])
def test_hsdp_on_a_network_not_replicated_names_world_replicate(mode: str) -> None:
    """Optimizer parallel (hsdp) on a network built outside the world, without
    ``world.replicate(net)``: cutting each rank's shard out of the one shared parameter failed
    inside torch (an AssertionError on ``aten.slice``); now the same ValueError as without
    hsdp, naming world.replicate."""
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with simulated_world(2) as world:
        opt = torch.optim.SGD(net.parameters(), 0.1)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode=mode).hsdp(threshold=0)
        with pytest.raises(ValueError, match=r"into a parameter .* Call world\.replicate\(net\)"):
            parallel(world.rows(x), world.rows(y))
