"""DistributedGradReducer: mean/sum of gradients over ranks, one AllReduce per bucket, the
MindSpore tuple form, and buffers reused across steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world


def test_in_place_mean_and_buckets() -> None:
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))  # 16.6 KiB of float32 gradients
    with simulated_world(4) as world, CommRecorder() as rec:
        world.replicate(net)
        grads = {
            n: world.rank_map(lambda r, p=p: torch.full_like(p, float(r)))
            for n, p in net.named_parameters()
        }
        for n, p in net.named_parameters():
            p.grad = grads[n].clone()
        reducer = sw.nn.DistributedGradReducer(net.parameters(), bucket_mb=16 * 1024 / 2**20)
        reducer()
        for _, p in net.named_parameters():
            assert_matches_single_device(p.grad, torch.full(p.shape, 1.5))  # (0+1+2+3)/4
        buffers = dict(reducer._bucket_buffers)
        reducer()  # a second step reuses the same flat buffers
        assert {k: id(v) for k, v in reducer._bucket_buffers.items()} == {
            k: id(v) for k, v in buffers.items()
        }
    # weight 0 alone fills the 16 KiB bucket; the three others share the second
    assert rec.count("AllReduce") == 2 * 2


def test_tuple_form_returns_reduced_copies_and_sum() -> None:
    with simulated_world(2) as world:
        g = world.rank_map(lambda r: torch.full((3,), 1.0 + r))
        (out,) = sw.nn.DistributedGradReducer([], mean=False)((g,))
        assert_matches_single_device(out, torch.full((3,), 3.0))
        assert_matches_single_device(g, lambda r: torch.full((3,), 1.0 + r))  # input untouched


def test_tuple_form_passes_unused_gradients_through() -> None:
    """``torch.autograd.grad(..., allow_unused=True)`` gives None for an unused input: it is
    returned as None (it failed with an AttributeError on None)."""
    with simulated_world(2) as world:
        g = world.rank_map(lambda r: torch.full((3,), 1.0 + r))
        first, out = sw.nn.DistributedGradReducer([], mean=True)((None, g))
        assert first is None
        assert out is not None
        assert_matches_single_device(out, torch.full((3,), 1.5))


def test_sparse_embedding_gradients_with_sparse_adam() -> None:
    """``nn.Embedding(sparse=True)`` beside a dense layer: the sparse gradient is summed over
    the ranks at the union of their rows (sparse again), so ``SparseAdam`` steps as on one device
    (it raised torch's "reshape is not implemented for sparse tensors")."""
    torch.manual_seed(0)
    ids = torch.tensor([[0, 5, 5], [1, 5, 7], [2, 3, 0], [9, 9, 1]])

    def make() -> nn.Sequential:
        torch.manual_seed(1)
        return nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1))

    def optimizers(net: nn.Sequential) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SparseAdam(net[0].parameters(), lr=0.1),
            torch.optim.SGD(net[1].parameters(), lr=0.1),
        ]

    one = make()
    one_opts = optimizers(one)
    for _ in range(2):
        one(ids).mean().backward()
        for o in one_opts:
            o.step()
            o.zero_grad()
    net = make()
    with simulated_world(4) as world, CommRecorder() as rec:
        world.replicate(net)
        opts = optimizers(net)
        reducer = sw.nn.DistributedGradReducer(net.parameters())
        for _ in range(2):
            net(world.rows(ids)).mean().backward()
            reducer()
            assert net[0].weight.grad is not None and net[0].weight.grad.is_sparse
            for o in opts:
                o.step()
                o.zero_grad()
    for p, q in zip(net.parameters(), one.parameters(), strict=True):
        assert_matches_single_device(p.detach(), q.detach())
    assert rec.count("AllReduce") == 2 * 3  # per step: the dense bucket, the rows, the values
    with pytest.raises(TypeError, match=r"gradient 0 has layout torch\.sparse_csr"):
        sw.nn.DistributedGradReducer([], degree=1)((torch.eye(3).to_sparse_csr(),))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"parameters": nn.Linear(2, 2)}, TypeError, r"module \(Linear\).*net\.parameters\(\)"),
        ({"parameters": nn.Sequential(nn.Linear(2, 2))}, TypeError, r"module \(Sequential\)"),
        ({"parameters": 3}, TypeError, r"iterable of parameters .*got int"),
        ({"parameters": torch.ones(2, requires_grad=True)}, TypeError, r"\[p\] for one"),
        ({"parameters": ["w"]}, TypeError, r"parameters\[0\] is a str"),
        ({"bucket_mb": "4"}, TypeError, r"bucket_mb='4' must be a number of MiB > 0"),
        ({"bucket_mb": 0}, ValueError, r"bucket_mb=0 must be > 0"),
        ({"mean": "no"}, TypeError, r"mean='no' must be True .* or False"),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, object], error: type, match: str) -> None:
    """Each wrong argument is named with its fix (a module: its ``parameters()``), not a raw
    Python error from inside or silently accepted (``mean="no"`` averaged)."""
    args = {"parameters": nn.Linear(2, 2).parameters(), **kwargs}
    with pytest.raises(error, match=match):
        sw.nn.DistributedGradReducer(**args)  # type: ignore[arg-type]


def test_float16_mean_divides_before_the_sum() -> None:
    """float16 gradients of 31248 per element on 4 ranks (float16's largest value is 65504):
    their mean is one device's gradient, their sum inf. Each rank's share is divided before the
    sum, as DDP (the sum overflowed to inf, in place and in the tuple form)."""
    x = torch.ones(8, 64, dtype=torch.float16)

    def make() -> nn.Linear:
        net = nn.Linear(64, 64, bias=False).half()
        with torch.no_grad():
            net.weight.fill_(0.01)
        return net

    one = make()
    (one(x).float().mean() * 2e6).backward()
    want = one.weight.grad
    assert want is not None and torch.isfinite(want).all() and want.abs().max() > 30000
    net = make()
    with simulated_world(4) as world, CommRecorder() as rec:
        world.replicate(net)
        (net(world.rows(x)).float().mean() * 2e6).backward()
        grad = net.weight.grad
        assert grad is not None
        (copy,) = sw.nn.DistributedGradReducer([])((grad,))
        sw.nn.DistributedGradReducer(net.parameters())()
        assert_matches_single_device(net.weight.grad, want, what="in place")
        assert_matches_single_device(copy, want, what="tuple form")
    assert rec.count("AllReduce") == 2


class Tied(nn.Module):
    """An embedding shared by an encoder and a decoder (its weight in both's parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared = nn.Embedding(10, 4)
        self.enc = nn.ModuleDict({"emb": shared, "proj": nn.Linear(4, 4)})
        self.dec = nn.ModuleDict({"emb": shared})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.enc["proj"](self.enc["emb"](ids))
        return (h @ self.dec["emb"].weight.T).pow(2).sum()


def test_a_parameter_listed_twice_is_reduced_once() -> None:
    """``list(enc.parameters()) + list(dec.parameters())`` lists a tied embedding twice: it is
    summed once (with the two entries in other buckets its gradient was summed twice, 4 times
    the sum on 4 ranks)."""
    ids = torch.tensor([[0, 5], [1, 7], [2, 3], [9, 1]])
    one = Tied()
    one(ids).backward()  # (a sum over the rows: the ranks' sum)
    want = {n: p.grad for n, p in one.named_parameters()}
    net = Tied()
    with simulated_world(4) as world, CommRecorder() as rec:
        world.replicate(net)
        net(world.rows(ids)).backward()
        params = list(net.enc.parameters()) + list(net.dec.parameters())
        assert len(params) == 4
        sw.nn.DistributedGradReducer(params, mean=False, bucket_mb=1e-4)()  # (one per bucket)
        got = {n: p.grad for n, p in net.named_parameters()}
        assert_matches_single_device(got, want, what="gradients")
    assert rec.count("AllReduce") == 2  # (the embedding's bucket, the projection's)


def test_a_parameter_unfrozen_after_the_reducer_is_built_is_reduced() -> None:
    """A layer frozen when the reducer is built and unfrozen later (fine-tuning) is averaged
    (it kept each rank's own gradient: the ranks' weights drifted apart); one frozen later is
    left alone."""
    x = torch.arange(8.0).view(4, 2)

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))

    one = make()
    one(x).mean().backward()
    want = {n: p.grad for n, p in one.named_parameters()}
    net = make()
    net[0].requires_grad_(False)
    with simulated_world(2) as world, CommRecorder() as rec:
        world.replicate(net)
        reducer = sw.nn.DistributedGradReducer(net.parameters())
        net[0].requires_grad_(True)
        net(world.rows(x)).mean().backward()
        reducer()
        got = {n: p.grad for n, p in net.named_parameters()}
        assert_matches_single_device(got, want, what="gradients")
        net[1].requires_grad_(False)  # (frozen again: its gradient is no longer touched)
        own = world.rank_map(lambda r: torch.full((1, 2), float(r)))  # (each rank's own)
        net[1].weight.grad = own
        reducer()
        kept = net[1].weight.grad
        assert_matches_single_device(kept, lambda r: torch.full((1, 2), float(r)), what="frozen")
    assert rec.count("AllReduce") == 2
