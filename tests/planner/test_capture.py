"""`planner.capture`: every op of a forward or train step, on fake tensors, with module paths,
edges, global shapes and the aten ops each ran; keyword inputs and dataclass outputs; clear
errors for what it cannot follow."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from shardwise.planner import CaptureError, Ref, capture
from shardwise.testing.models import GPTBlock, GPTConfig, megatron_strategies

from ..zoo import GPT2, gpt2_hf


def test_gpt2_graph_has_every_op_with_edges_and_paths() -> None:
    net = GPT2()
    ids = torch.zeros(8, 16, dtype=torch.long)
    graph = capture(net, ids, ids)
    ops = [n.op.rsplit(".", 1)[-1] for n in graph.nodes]
    for op in ("embedding", "layer_norm", "linear", "split", "view", "transpose"):
        assert op in ops
    assert "scaled_dot_product_attention" in ops and ops[-1] == "cross_entropy"
    attn = next(n for n in graph.nodes if n.name == "transformer.h.0.attn.c_attn/linear")
    assert attn.inputs[1] == Ref("param", "transformer.h.0.attn.c_attn.weight")
    assert attn.outputs[0].shape == (8, 16, 96)
    assert [str(a.op) for a in attn.aten] == [
        "aten.view.default",
        "aten.t.default",
        "aten.addmm.default",
        "aten.view.default",
    ]
    view = graph.nodes[-3]  # logits.view(-1, V): folds the batch into the rows
    assert view.op == "torch.Tensor.view" and view.outputs[0].shape == (128, 64)
    assert graph.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert graph.outputs[-1] == Ref("node", len(graph.nodes) - 1)
    assert graph.inputs["args[0]"].shape == (8, 16)


def test_capture_computes_nothing_and_leaves_the_network_alone() -> None:
    with torch.device("meta"):
        net = GPT2(n_layer=4)  # no memory: the parameters are meta tensors
    graph = capture(net, torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))
    assert len(graph.params) == len(list(net.parameters()))
    assert all(p.device.type == "meta" for p in net.parameters())


def test_train_step_with_keywords_and_dataclass_output() -> None:
    net = gpt2_hf()
    opt = torch.optim.AdamW(net.parameters())

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = net(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()  # (not run: capture ends at backward)
        return loss

    graph = capture(step, torch.zeros(4, 16, dtype=torch.long), networks=[net])
    (loss,) = graph.outputs  # the root of backward
    assert graph.nodes[int(loss.key)].op == "torch.nn.functional.cross_entropy"
    assert all(p.grad is None for p in net.parameters())


def test_primitives_are_single_nodes() -> None:
    cfg = GPTConfig()
    net = GPTBlock(cfg, megatron_strategies(2, 4))
    ids = torch.zeros(8, cfg.seq, dtype=torch.long)
    onehot = torch.zeros(8 * cfg.seq, cfg.vocab)
    graph = capture(net, ids, onehot)
    prims = [n for n in graph.nodes if n.is_primitive]
    assert len(prims) == len(graph.nodes)  # GPTBlock is primitives only
    assert prims[0].op == "shardwise.ops.Gather" and not prims[0].aten


class ItemInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # data-dependent control flow
            return h
        return -h


class Lambda(nn.Module):
    def __init__(self, f: Any) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x)  # type: ignore[no-any-return]


class NonzeroInForward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x[x > 0])


@pytest.mark.parametrize(
    ("net", "match"),
    [
        (ItemInForward(), r"__bool__ at test_capture.py:\d+ reads a tensor's value .* torch.where"),
        (NonzeroInForward(), r"__getitem__ at test_capture.py:\d+ has an output whose shape"),
        (  # (a value read inside torch's own C++ op, not an output shaped by values)
            Lambda(lambda x: torch.cov(x.t())),
            r"torch.cov at test_capture.py:\d+ reads a tensor's value inside torch \(aten.equal",
        ),
        (  # (a packed sequence: its hint, not boolean indexing's)
            Lambda(
                lambda x: nn.utils.rnn.pack_padded_sequence(
                    x.unsqueeze(0), torch.tensor([2]), batch_first=True
                ).data.sum()
            ),
            r"pack_padded_sequence at test_capture.py:\d+ has an output whose shape .*padded "
            r"batch without packing",
        ),
        (  # (torch's Python check of the variances, named with its line)
            Lambda(lambda x: F.gaussian_nll_loss(x, x * 2, torch.ones_like(x))),
            r"gaussian_nll_loss at test_capture.py:\d+ reads a tensor's value inside torch "
            r"\(functional.py:\d+, gaussian_nll_loss\).* 0.5 \* \(torch.log\(var\)",
        ),
        (  # (one_hot without num_classes reads the largest id: pass the count)
            Lambda(lambda x: F.one_hot(x.argmax(-1)).float().sum()),
            r"one_hot at test_capture.py:\d+ reads a tensor's value inside torch .*"
            r"F.one_hot\(ids, num_classes=E\)\); or run the step with "
            r"parallel_mode='data_parallel'",
        ),
        (  # (MoE load counts: bincount's output has as many bins as the largest id)
            Lambda(lambda x: torch.bincount(x.argmax(-1), minlength=4).float().sum()),
            r"bincount at test_capture.py:\d+ has an output whose shape .*F.one_hot\(ids, "
            r"E\).sum\(0\).*parallel_mode='data_parallel', which captures nothing",
        ),
        (  # (a tensor's storage cannot be deep-copied on fakes; the line past copy.py)
            Lambda(lambda x: copy.deepcopy(x * 2)),
            r"copy.deepcopy of a tensor at test_capture.py:\d+ .* t.detach\(\).clone\(\)",
        ),
    ],
)
def test_values_in_the_forward_name_the_op_and_line(net: nn.Module, match: str) -> None:
    with pytest.raises(CaptureError, match=match):
        capture(net, torch.ones(2, 4))


class MaskedEncoder(nn.Module):
    """torch's own tutorial use: ``nn.TransformerEncoder(src, mask)``; torch reads the mask's
    values to tell whether it is causal (``is_causal=None``)."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        out: torch.Tensor = self.enc(x, mask)
        return out


def test_a_value_read_inside_torch_names_torchs_function_and_the_argument() -> None:
    """The error names the user's line, torch's function that reads the value and what to pass
    instead (it gave the advice for the user's own code: torch.where)."""
    with pytest.raises(CaptureError) as info:
        capture(MaskedEncoder(), torch.ones(2, 4, 8))
    message = str(info.value)
    assert re.search(r"at test_capture.py:\d+ reads a tensor's value", message), message
    assert "transformer.py" in message and "(_detect_is_causal_mask)" in message, message
    assert "pass is_causal=True" in message and "torch.where" not in message, message


class Checkpointed(nn.Module):
    """An MLP whose hidden layer runs in activation checkpointing (`how`)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.how = nn.Linear(4, 8), nn.Linear(8, 2), how
        self.composed = composable_checkpoint(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "composable":
            return self.fc2(self.composed(x))
        if self.how == "sequential":
            h = checkpoint_sequential(nn.Sequential(self.fc1, nn.ReLU()), 1, x, use_reentrant=False)
        else:
            h = checkpoint(self.hidden, x, use_reentrant=self.how == "reentrant")
        out: torch.Tensor = self.fc2(h)
        return out


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # (fake inputs)
@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "sequential", "composable"])
def test_activation_checkpointing_is_captured(how: str) -> None:
    """The region's ops are nodes like any others (its recomputation replays them:
    tests/parallel/test_activation_checkpointing.py)."""
    graph = capture(Checkpointed(how), torch.ones(2, 4, requires_grad=True))
    assert [n.op.rsplit(".", 1)[-1] for n in graph.nodes] == ["linear", "relu", "linear"]


class Experts(nn.Module):
    """Two experts' matmuls in one grouped matmul over float32 rows (``F.grouped_mm``: its CPU
    kernel takes float32, its fake kernel bfloat16 only), as Hugging Face's MoE layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([4, 8], dtype=torch.int32)
        return F.grouped_mm(x, self.w, offs=offs)


def test_a_call_whose_fake_kernel_refuses_it_names_the_kernel_the_line_and_the_fix() -> None:
    """One device runs it; the capture (fake tensors) cannot: a CaptureError naming the call,
    the user's line, torch's kernel and its message, and what to use (it was torch's bare
    RuntimeError from inside the capture)."""
    net, x = Experts(), torch.randn(8, 8)
    assert net(x).shape == (8, 8)
    line = Experts.forward.__code__.co_firstlineno + 2
    with pytest.raises(CaptureError) as info:
        capture(net, x)
    msg = str(info.value)
    assert msg.startswith(
        f"_VariableFunctionsClass._grouped_mm at test_capture.py:{line} failed while the step was "
        f"captured on fake tensors (shapes and dtypes only): torch's fake kernel "
        f"_meta_grouped_mm_common refused it: Expected inputs of BF16 type"
    ), msg
    assert msg.endswith("experts_implementation='batched_mm' in the model's config"), msg
    assert isinstance(info.value, RuntimeError)  # (torch's type too: code catching it still does)


class WrongShapes(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ torch.ones(3, 2)  # (x is [4, 5]: fails on one device too)
        return torch.cat([y, torch.ones(4, 3)], dim=0)


def test_a_shape_error_during_capture_keeps_torchs_error_and_names_the_line() -> None:
    """A shape error a meta kernel raises names the line and both readings; torch's other
    errors stay torch's, with a note naming the call and the line."""
    line = WrongShapes.forward.__code__.co_firstlineno + 1
    with pytest.raises(RuntimeError) as info:
        capture(WrongShapes(), torch.ones(4, 5))
    assert f"at test_capture.py:{line} failed while the step was captured" in str(info.value)
    assert "a and b must have same reduction dim" in str(info.value)
    assert "If it fails on one device too, fix what torch names" in str(info.value)

    class WrongCat(WrongShapes):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, torch.ones(4, 3)], dim=0)

    with pytest.raises(RuntimeError, match="Sizes of tensors must match") as info:
        capture(WrongCat(), torch.ones(4, 5))
    assert not isinstance(info.value, CaptureError)
    assert any("while shardwise captured the step" in n for n in info.value.__notes__)


class ScaleByMax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max().item()  # a Python number from a tensor
        return x / scale


class SplitByCounts(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = F.one_hot(x.argmax(-1), 4).sum(0)
        return sum(p.sum() for p in torch.split(x, counts.tolist()))  # type: ignore[return-value]


def test_tolist_in_the_forward_is_named_tolist() -> None:
    """Fake tensors read a ``tolist`` element by element with ``item``: the error names the
    call the user wrote, with the fixed-capacity advice."""
    with pytest.raises(CaptureError, match=r"^torch.Tensor.tolist at test_capture.py:\d+ .*"
                       r"counts.tolist\(\)"):  # fmt: skip
        capture(SplitByCounts(), torch.ones(8, 4))


def test_item_in_the_forward_names_the_op_the_line_and_the_fix() -> None:
    """``.item()`` in the forward: the error names ``item``, the user's file:line and what to do
    instead (fake tensors have no values to turn into a number)."""
    line = ScaleByMax.forward.__code__.co_firstlineno + 1
    with pytest.raises(CaptureError) as info:
        capture(ScaleByMax(), torch.ones(2, 4))
    assert str(info.value) == (
        f"torch.Tensor.item at test_capture.py:{line} reads a tensor's value while the network "
        f"is captured (fake tensors have no values); keep values out of the forward (log the "
        f"loss after loss.backward(), use torch.where instead of Python if on a tensor, a fixed "
        f"capacity per part instead of sizes read from a tensor (torch.split(x, "
        f"counts.tolist()))); or run the step with parallel_mode='data_parallel', which "
        f"captures nothing and runs it as written"
    )
