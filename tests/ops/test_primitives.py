"""Single-device forward (and backward) of every primitive against a direct torch computation;
shard() type checks; module paths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.layout import LayoutTypeError
from shardwise.ops import (
    Add,
    BatchMatMul,
    BiasAdd,
    Div,
    Dropout,
    Flatten,
    Gather,
    GeLU,
    LayerNorm,
    LogSoftmax,
    MatMul,
    Mul,
    Primitive,
    ReduceMean,
    ReduceSum,
    ReLU,
    Reshape,
    Sigmoid,
    Softmax,
    SoftmaxCrossEntropyWithLogits,
    Sub,
    Tanh,
    Transpose,
    name_primitives,
)

torch.manual_seed(0)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("ta", "tb"), [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_transposes(ta: bool, tb: bool) -> None:
    x, w = torch.randn(6, 4), torch.randn(4, 5)
    xa, wb = (x.t().contiguous() if ta else x), (w.t().contiguous() if tb else w)
    close(MatMul(ta, tb)(xa, wb), x @ w)


def test_matmul_rejects_batches() -> None:
    with pytest.raises(ValueError, match="BatchMatMul"):
        MatMul()(torch.randn(2, 3, 4), torch.randn(4, 5))
    with pytest.raises(TypeError, match="transpose_a"):
        MatMul(transpose_a=1)  # type: ignore[arg-type]


def test_batch_matmul_broadcast_and_transpose() -> None:
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    close(BatchMatMul(transpose_b=True)(q, k), q @ k.transpose(-1, -2))
    x, w = torch.randn(2, 3, 5, 4), torch.randn(4, 6)
    close(BatchMatMul()(x, w), torch.matmul(x, w))
    close(BatchMatMul(transpose_a=True)(x.transpose(-1, -2), w), torch.matmul(x, w))


def test_binary_ops_broadcast_and_scalars() -> None:
    x, y = torch.randn(4, 3), torch.rand(3) + 0.5
    for op, ref in [(Add(), x + y), (Sub(), x - y), (Mul(), x * y), (Div(), x / y)]:
        close(op(x, y), ref)
    close(Add()(x, 2.0), x + 2.0)
    close(Div()(torch.arange(4), 2), torch.arange(4) / 2)  # true division


def test_bias_add_formats() -> None:
    x, b = torch.randn(2, 3, 4, 5), torch.randn(3)
    close(BiasAdd()(x, b), x + b.view(1, 3, 1, 1))
    close(BiasAdd()(x[:, :, 0, 0], b), x[:, :, 0, 0] + b)
    xh, bh = torch.randn(2, 4, 5, 3), torch.randn(3)
    close(BiasAdd("NHWC")(xh, bh), xh + bh)
    with pytest.raises(ValueError, match="data_format"):
        BiasAdd("NWC")


def test_activations() -> None:
    x = torch.randn(5, 7)
    close(ReLU()(x), torch.relu(x))
    close(Sigmoid()(x), torch.sigmoid(x))
    close(Tanh()(x), torch.tanh(x))
    tanh_form = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    close(GeLU()(x), tanh_form)


def test_gelu_matches_mindspore_documented_values() -> None:
    # mindspore.ops.GeLU docs: GeLU()([1., 2., 3.]) -> [0.841192, 1.9545976, 2.9963627]
    out = GeLU()(torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(
        out, torch.tensor([0.841192, 1.9545976, 2.9963627]), atol=1e-6, rtol=0
    )


def test_softmax_and_log_softmax() -> None:
    x = torch.randn(3, 4, 5)
    close(Softmax()(x), torch.softmax(x, -1))
    close(Softmax(1)(x), torch.softmax(x, 1))
    both = torch.exp(x) / torch.exp(x).sum(dim=(1, 2), keepdim=True)
    close(Softmax((1, 2))(x), both)
    close(LogSoftmax(0)(x), torch.log_softmax(x, 0))
    with pytest.raises(TypeError):
        LogSoftmax((0, 1))  # type: ignore[arg-type]


def test_layer_norm_outputs_and_gradients() -> None:
    x = torch.randn(4, 6, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    y, mean, rstd = LayerNorm(-1, -1, 1e-5)(x, g, b)
    ref = F.layer_norm(x, (8,), g, b, 1e-5)
    close(y, ref)
    assert mean.shape == rstd.shape == (4, 6, 1)
    close(mean, x.mean(-1, keepdim=True))
    close(rstd, 1 / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5))
    seed = torch.randn_like(ref)
    grads = torch.autograd.grad((y * seed).sum(), (x, g, b))
    refs = torch.autograd.grad((ref * seed).sum(), (x, g, b))
    for got, want in zip(grads, refs, strict=True):
        close(got, want)


def test_layer_norm_params_axis_before_norm_axis() -> None:
    # begin_params_axis=1 < begin_norm_axis=2: gamma [6, 8] scales dims 1 and 2
    x = torch.randn(4, 6, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    y, mean, _ = LayerNorm(2, 1)(x, g, b)
    ref = F.layer_norm(x, (8,), eps=1e-7) * g + b
    close(y, ref)
    assert mean.shape == (4, 6, 1)
    gx, gg = torch.autograd.grad(y.sum(), (x, g))
    rx, rg = torch.autograd.grad(ref.sum(), (x, g))
    close(gx, rx)
    close(gg, rg)


def test_softmax_cross_entropy_outputs_and_gradient() -> None:
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 4, 2, 1, 3, 0])
    labels = F.one_hot(target, 5).double()
    loss, backprop = SoftmaxCrossEntropyWithLogits()(logits, labels)
    close(loss, F.cross_entropy(logits, target, reduction="none"))
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    close(backprop, grad)
    (ref,) = torch.autograd.grad(F.cross_entropy(logits, target, reduction="sum"), logits)
    close(grad, ref)


def test_gather_embedding_and_axes() -> None:
    table, ids = torch.randn(10, 4), torch.tensor([[1, 7, 7], [0, 9, 3]])
    close(Gather()(table, ids, 0), F.embedding(ids, table))
    p = torch.randn(3, 5, 2)
    idx = torch.tensor([4, 0])
    close(Gather()(p, idx, 1), p[:, idx])
    close(Gather()(p, torch.tensor([1, 1, 0]), -1), p[..., [1, 1, 0]])


def test_gather_batch_dims() -> None:
    p, idx = torch.randn(2, 5, 3), torch.tensor([[0, 4], [2, 2]])
    out = Gather(batch_dims=1)(p, idx, 1)
    assert out.shape == (2, 2, 3)
    close(out, torch.stack([p[0, idx[0]], p[1, idx[1]]]))
    out2 = Gather(batch_dims=1)(p, torch.tensor([[1], [0]]), 2)
    close(out2, torch.stack([p[0][:, [1]], p[1][:, [0]]]))


def test_gather_gradient_is_a_scatter_add() -> None:
    table = torch.randn(6, 3, requires_grad=True)
    ids = torch.tensor([1, 1, 4])
    (g,) = torch.autograd.grad(Gather()(table, ids, 0).sum(), table)
    assert g[1].tolist() == [2.0, 2.0, 2.0] and g[4].tolist() == [1.0] * 3 and g[0].sum() == 0


def test_shape_ops() -> None:
    x = torch.randn(2, 3, 4, 5)
    close(Flatten()(x), x.reshape(2, 60))
    assert Flatten()(torch.randn(4)).shape == (4, 1)
    assert Flatten()(torch.randn(0, 1, 28, 28)).shape == (0, 784)  # (as torch.nn.Flatten)
    close(Reshape()(x, (6, -1)), x.reshape(6, 20))
    close(Transpose()(x, (0, 2, 1, 3)), x.permute(0, 2, 1, 3))


def test_reductions() -> None:
    x = torch.randn(3, 4, 5)
    close(ReduceSum()(x, 1), x.sum(1))
    close(ReduceSum(keep_dims=True)(x, (0, 2)), x.sum((0, 2), keepdim=True))
    close(ReduceSum()(x), x.sum())
    close(ReduceMean()(x, [-1]), x.mean(-1))
    close(ReduceMean(keep_dims=True)(x), x.mean((0, 1, 2), keepdim=True))
    close(ReduceSum(skip_mode=True)(x, ()), x)


def test_dropout_mask_scale_and_eval() -> None:
    drop = Dropout(keep_prob=0.75)
    x = torch.ones(400, 50)
    out, mask = drop(x)
    assert mask.dtype == x.dtype and mask.shape == x.shape
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    close(out, x * mask / 0.75)
    assert abs(mask.mean().item() - 0.75) < 0.02
    drop.eval()
    out, mask = drop(x)
    assert torch.equal(out, x) and bool(mask.all())
    with pytest.raises(ValueError, match="keep_prob"):
        Dropout(0.0)


def test_dropout_seeds_reproduce() -> None:
    a, b = Dropout(0.5, Seed0=3, Seed1=7), Dropout(0.5, Seed0=3, Seed1=7)
    x = torch.ones(64)
    assert torch.equal(a(x)[1], b(x)[1])
    assert not torch.equal(a(x)[1], a(x)[1])  # the stream advances


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"Seed0": 2**32}, ValueError, r"Seed0 must be in \[0, 2\*\*32 - 1\].*got 4294967296"),
        ({"Seed1": -1}, ValueError, r"Seed1 must be in \[0, 2\*\*32 - 1\].*got -1"),
        ({"Seed0": 1.5}, TypeError, r"Seed0 must be an int .*got 1\.5 \(float\)"),
        ({"Seed1": True}, TypeError, r"Seed1 must be an int .*got True \(bool\)"),
        ({"keep_prob": True}, TypeError, r"keep_prob must be a float in \(0, 1\], got True"),
        ({"keep_prob": "0.5"}, TypeError, r"keep_prob must be a float"),
        ({"keep_prob": 1.5}, ValueError, r"keep_prob must be in \(0, 1\], got 1\.5"),
    ],
)
def test_dropout_arguments_are_checked_at_construction(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    """A seed past 32 bits failed only at the first forward ("Overflow when unpacking long
    long", naming neither op nor argument); a float seed and keep_prob=True were taken."""
    with pytest.raises(error, match="^Dropout: " + message):
        Dropout(**kwargs)  # type: ignore[arg-type]


def test_dropout_distinct_seed_pairs_draw_distinct_masks() -> None:
    """(Seed0=1, Seed1=0) and (Seed0=0, Seed1=2**32) drew the same mask (the second pair is now
    refused), and so did any two pairs with the same Seed1: torch's CPU generator keeps a seed's
    low 32 bits, which were Seed1 alone."""
    x = torch.ones(256)
    top = 2**32 - 1
    pairs = [(1, 0), (2, 0), (0, 1), (1, 1), (3, 5), (7, 5), (0, top), (top, 0), (top, top)]
    masks = [Dropout(0.5, Seed0=a, Seed1=b)(x)[1] for a, b in pairs]
    for i in range(len(masks)):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), (pairs[i], pairs[j])


def test_primitives_run_on_meta_tensors() -> None:
    # capture runs networks on meta tensors: every forward must work there
    meta = torch.device("meta")
    x = torch.empty(8, 16, device=meta)
    assert MatMul()(x, torch.empty(16, 4, device=meta)).shape == (8, 4)
    assert LayerNorm()(x, torch.empty(16, device=meta), torch.empty(16, device=meta))[0].shape == (
        8,
        16,
    )
    assert Dropout()(x)[1].shape == (8, 16)
    ids = torch.empty(8, dtype=torch.long, device=meta)
    assert Gather()(torch.empty(100, 16, device=meta), ids, 0).shape == (8, 16)


class Network(torch.nn.Module):
    """Seed 003's network (smaller), built from shardwise primitives: trains on one device."""

    def __init__(self) -> None:
        super().__init__()
        self.flatten = Flatten()
        self.fc1_weight = torch.nn.Parameter(torch.randn(8 * 8, 32) * 0.1)
        self.fc2_weight = torch.nn.Parameter(torch.randn(32, 10) * 0.1)
        self.matmul1 = MatMul().shard(((2, 4), (4, 1)))
        self.relu1 = ReLU().shard(((4, 1),))
        self.matmul2 = MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul2(
            self.relu1(self.matmul1(self.flatten(x), self.fc1_weight)), self.fc2_weight
        )


def test_network_of_primitives_trains_on_one_device() -> None:
    torch.manual_seed(1)
    net = Network()
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(net(x), y)
        grads = torch.autograd.grad(loss, list(net.parameters()))
        with torch.no_grad():
            for param, grad in zip(net.parameters(), grads, strict=True):
                param -= 0.5 * grad
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_name_primitives_sets_module_paths() -> None:
    net = Network()
    assert net.matmul1.who == "MatMul"
    found = name_primitives(net, "net")
    assert list(found) == ["net.flatten", "net.matmul1", "net.relu1", "net.matmul2"]
    assert net.matmul1.who == "net.matmul1 (MatMul)"
    assert name_primitives(net)["matmul1"] is net.matmul1


def test_shard_stores_normalized_strategies_and_returns_self() -> None:
    mm = MatMul()
    assert mm.shard([[2, 4], [4, 1]]) is mm
    assert mm.in_strategy == ((2, 4), (4, 1)) and mm.out_strategy is None
    mm.shard(((2, 4), (4, 1)), ((8, 1),))
    assert mm.out_strategy == ((8, 1),)
    layout = sw.Layout((2, 4), ("dp", "mp"))
    mm.shard((layout("dp", "mp"), layout("mp", "None")))
    assert mm.in_strategy is not None and mm.in_strategy[0] == layout("dp", "mp")
    assert "in_strategy=(layout('dp', 'mp'), layout('mp', 'None'))" in repr(mm)
    assert isinstance(mm, Primitive) and isinstance(mm, torch.nn.Module)


def test_shard_type_errors() -> None:
    layout = sw.Layout((2, 4), ("dp", "mp"))
    with pytest.raises(ValueError, match="mixes int tuples and Layouts"):
        MatMul().shard(((2, 4), layout("mp", "None")))
    with pytest.raises(ValueError, match="in_strategy and out_strategy mix"):
        MatMul().shard(((2, 4), (4, 1)), (layout("dp", "None"),))
    with pytest.raises(LayoutTypeError, match=r"one tuple per input: \(\(2, 4\),\)"):
        MatMul().shard((2, 4))
    with pytest.raises(TypeError, match="call it with one alias per tensor dim"):
        MatMul().shard((layout, layout))
    with pytest.raises(TypeError, match="tuple of ints or a Layout call"):
        ReLU().shard((("a", 1),))
    with pytest.raises(ValueError, match="out_strategy needs an in_strategy"):
        MatMul().shard(None, ((8, 1),))
    with pytest.raises(TypeError, match="one entry per input"):
        ReLU().shard("dp")
    # (a value below 1 is refused by shard() itself, not only when a plan is made)
    with pytest.raises(ValueError, match=r"in_strategy entry 0 \(0, 4\) splits dim 0 into 0 parts"):
        MatMul().shard(((0, 4), (4, 1)))
    with pytest.raises(ValueError, match=r"out_strategy entry 0 \(4, -1\) splits dim 1 into -1"):
        MatMul().shard(((2, 4), (4, 1)), ((4, -1),))
