"""no_init_parameters: nothing allocated, bit-identical replay, optimizers, slices, RNG rule."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import shardwise.parameter as swp
from shardwise.parameter import (
    DeferredInitError,
    Parameter,
    initializer,
    is_deferred,
    materialize,
    materialized_values,
    no_init_parameters,
)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.layer1 = nn.Linear(784, 512)
        self.layer2 = nn.Linear(512, 512)
        self.layer3 = nn.Linear(512, 10)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.layer1(self.flatten(x)))
        return self.layer3(self.relu(self.layer2(x)))


class MatMulNet(nn.Module):
    """The operator-parallel seed: sw.Parameter(sw.initializer(...)) attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1_weight = Parameter(initializer("normal", [784, 512]), name="fc1")
        self.fc2_weight = Parameter(initializer("normal", [512, 512]))
        self.fc3_weight = Parameter(initializer("normal", [512, 10]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(x.flatten(1) @ self.fc1_weight)
        return torch.relu(x @ self.fc2_weight) @ self.fc3_weight


class Mixed(nn.Module):
    """Every kind of construction interleaved: the RNG order must still match."""

    def __init__(self) -> None:
        super().__init__()
        self.w0 = Parameter(initializer("he_normal", [16, 8]))
        self.conv = nn.Conv2d(3, 4, 3)
        self.emb = nn.Embedding(10, 6, padding_idx=2)
        self.w1 = Parameter(initializer("truncated_normal", [8, 8]))
        self.norm = nn.LayerNorm(6)
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Linear(6, 4)
        nn.init.orthogonal_(self.fc.weight)
        self.w2 = Parameter(initializer("xavier_uniform", [4, 6]))
        self.register_buffer("noise", torch.randn(3))


def _eager(cls: type[nn.Module], seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


def _deferred(cls: type[nn.Module], seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    with no_init_parameters():
        return cls()


def _assert_identical(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def test_nothing_is_allocated() -> None:
    net = _deferred(MLP)
    tensors = [*net.parameters(), *net.buffers()]
    assert tensors and all(t.is_meta for t in tensors)
    assert all(is_deferred(t) for t in tensors)
    assert net.layer1.weight.shape == (512, 784)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_a_1gb_model_costs_no_memory() -> None:
    def rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], 0.1)  # torch's one-off imports
    before = rss()
    with no_init_parameters():
        net = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(16)])
        torch.optim.SGD(net.parameters(), 1e-2, momentum=0.9)
    nbytes = sum(p.numel() * p.element_size() for p in net.parameters())
    assert nbytes > 2**30
    assert rss() - before < 64 * 2**20
    assert all(p.is_meta for p in net.parameters())


@pytest.mark.parametrize("cls", [MLP, MatMulNet, Mixed])
def test_materialize_is_bit_identical_to_eager(cls: type[nn.Module]) -> None:
    eager = _eager(cls)
    state_after_eager = torch.get_rng_state()
    net = _deferred(cls)
    materialize(net)
    _assert_identical(eager, net)
    assert not any(t.is_meta for t in net.state_dict().values())
    # Nobody drew numbers since the block: the RNG continues as after the eager build.
    assert torch.equal(torch.get_rng_state(), state_after_eager)


def test_first_forward_materializes_automatically() -> None:
    eager = _eager(MLP)
    net = _deferred(MLP)
    x = torch.ones(2, 1, 28, 28)
    assert torch.equal(net(x), eager(x))
    _assert_identical(eager, net)


def test_optimizer_built_inside_the_block_trains_the_real_tensors() -> None:
    eager = _eager(MatMulNet)
    eager_opt = torch.optim.Adam(eager.parameters(), 1e-3)
    torch.manual_seed(1)
    with no_init_parameters():
        net = MatMulNet()
        opt = torch.optim.Adam(net.parameters(), 1e-3)
    objects = [id(p) for p in net.parameters()]
    x = torch.randn(4, 784)
    for model, optimizer in ((eager, eager_opt), (net, opt)):
        for _ in range(2):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert [id(p) for p in net.parameters()] == objects
    assert opt.param_groups[0]["params"][0] is net.fc1_weight
    assert opt.state[net.fc1_weight]["exp_avg"].device.type == "cpu"
    assert net.fc1_weight.name == "fc1" and isinstance(net.fc1_weight, Parameter)
    _assert_identical(eager, net)


def test_slice_materialization_equals_slice_of_full_init() -> None:
    full = _eager(MatMulNet)
    net = _deferred(MatMulNet)

    def rows_of_rank_1_of_4(name: str, shape: tuple[int, ...]) -> slice:
        step = shape[0] // 4
        return slice(step, 2 * step)

    materialize(net, slicer=rows_of_rank_1_of_4)
    for name, param in full.named_parameters():
        local = dict(net.named_parameters())[name]
        assert local.shape[0] == param.shape[0] // 4
        assert torch.equal(local, param[param.shape[0] // 4 : param.shape[0] // 2])
        assert local.untyped_storage().nbytes() == local.numel() * 4  # a copy, not a view


def test_slice_of_plain_modules_and_column_slices() -> None:
    full = _eager(MLP)
    net = _deferred(MLP)
    materialize(
        net, slicer=lambda name, shape: (slice(None), slice(0, 2)) if len(shape) == 2 else None
    )
    assert torch.equal(net.layer2.weight, full.layer2.weight[:, :2])
    assert torch.equal(net.layer2.bias, full.layer2.bias)


def test_materialized_values_leave_the_module_deferred() -> None:
    full = _eager(MatMulNet)
    net = _deferred(MatMulNet)
    values = materialized_values(net)
    assert torch.equal(values["fc2_weight"], full.fc2_weight)
    assert net.fc2_weight.is_meta
    materialize(net)
    _assert_identical(full, net)


def test_materialize_given_values_keeps_the_objects() -> None:
    full = _eager(MatMulNet)
    net = _deferred(MatMulNet)
    kept = net.fc2_weight
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="pass values, or a slicer"):
        materialize(net, values={}, slicer=lambda name, shape: None)
    with pytest.raises(ValueError, match="no value for"):
        materialize(net, values={})
    materialize(net, values=materialized_values(net))
    assert net.fc2_weight is kept and optimizer.param_groups[0]["params"][1] is kept
    _assert_identical(full, net)
    assert not is_deferred(kept)


def test_reseeding_inside_the_block_is_replayed() -> None:
    def build() -> nn.Module:
        first = nn.Linear(4, 4)
        torch.manual_seed(7)
        return nn.Sequential(first, nn.Linear(4, 4))

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    with no_init_parameters():
        net = build()
    materialize(net)
    _assert_identical(eager, net)


def test_rng_drawn_after_the_block_is_left_alone() -> None:
    net = _deferred(MLP)
    torch.randn(3)
    state = torch.get_rng_state()
    materialize(net)
    assert torch.equal(torch.get_rng_state(), state)
    _assert_identical(_eager(MLP), net)


def test_nested_blocks_and_bare_form_share_one_session() -> None:
    torch.manual_seed(3)
    with no_init_parameters:
        a = nn.Linear(3, 3)
        with no_init_parameters():
            b = nn.Linear(3, 3)
    torch.manual_seed(3)
    ea, eb = nn.Linear(3, 3), nn.Linear(3, 3)
    materialize(b)
    materialize(a)
    _assert_identical(ea, a)
    _assert_identical(eb, b)


def test_device_argument_and_module_to_inside_the_block() -> None:
    torch.manual_seed(5)
    with no_init_parameters():
        net = nn.Linear(3, 2).to(torch.float64)
    materialize(net, device="cpu")
    torch.manual_seed(5)
    assert torch.equal(net.weight, nn.Linear(3, 2).to(torch.float64).weight)


def test_errors() -> None:
    stray = nn.Linear(2, 2, device="meta")
    with pytest.raises(DeferredInitError, match="weight"):
        materialize(stray)
    with no_init_parameters():
        net = nn.Linear(2, 2)
        with pytest.raises(DeferredInitError, match="after leaving"):
            materialize(net)
        with pytest.raises(TypeError, match="floating point"):
            torch.empty(3, dtype=torch.int64).normal_()
    with pytest.raises(TypeError):
        materialize("net")  # type: ignore[arg-type]
    materialize(net)
    assert not net.weight.is_meta
    assert swp.materialize(net) is net  # nothing left to do


def _fill(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.fill_(7.0)


def _copy(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.copy_(torch.ones(t.shape))


def _row(t: torch.Tensor) -> None:
    with torch.no_grad():
        t[0].mul_(2.0)


CHANGES = {
    "nn.init.zeros_": nn.init.zeros_,
    "nn.init.constant_": lambda t: nn.init.constant_(t, 0.5),
    "fill_": _fill,
    "copy_": _copy,
    "a view's mul_": _row,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_the_block_is_refused_not_lost(change: str) -> None:
    """A deferred parameter changed in place after the block (where nothing records it) was
    materialized with the block's values, the change silently lost; it is now refused, naming
    the parameter and the fix, by every way to materialize."""
    with no_init_parameters():
        net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    CHANGES[change](net[2].weight)
    for make in (materialize, materialized_values):
        with pytest.raises(DeferredInitError, match=r"2\.weight changed.*inside the block"):
            make(net)
    with pytest.raises(DeferredInitError, match=r"Linear\.weight changed in place"):
        net(torch.ones(1, 4))  # (the first forward materializes)
    assert is_deferred(net[0].weight)


def test_a_refused_change_in_a_later_block_leaves_every_block_deferred() -> None:
    """A network made in two blocks, the second's parameter changed after it: materialize gave
    the first block's parameters their values before refusing the second's (half made)."""
    with no_init_parameters():
        backbone = nn.Linear(4, 4)
    with no_init_parameters():
        head = nn.Linear(4, 2)
    net = nn.Sequential(backbone, head)
    nn.init.zeros_(head.weight)
    with pytest.raises(DeferredInitError, match=r"1\.weight changed in place"):
        materialize(net)
    assert is_deferred(net[0].weight) and is_deferred(net[1].weight)
    with no_init_parameters():
        backbone = nn.Linear(4, 4)
    with no_init_parameters():
        head = nn.Linear(4, 2)
    net = nn.Sequential(backbone, head)
    values = {"0.weight": torch.ones(4, 4), "0.bias": torch.ones(4)}  # (none for the head)
    with pytest.raises(ValueError, match=r"no value for 1\.weight"):
        materialize(net, values=values)
    assert is_deferred(net[0].weight) and is_deferred(net[1].weight)


def test_load_state_dict_after_the_block_is_refused_load_param_into_net_fills() -> None:
    from shardwise.checkpoint import load_param_into_net

    values = {k: torch.full(v.shape, 0.25) for k, v in nn.Linear(4, 3).state_dict().items()}
    with no_init_parameters():
        net = nn.Linear(4, 3)
    with pytest.warns(UserWarning, match="no-op"):
        net.load_state_dict(values)  # (torch copies into meta tensors: nothing)
    with pytest.raises(DeferredInitError, match="bias, weight changed in place"):
        materialize(net)
    with no_init_parameters():
        net = nn.Linear(4, 3)
    assert load_param_into_net(net, {"weight": values["weight"]}) == (["bias"], [])
    materialize(net)  # (the bias: replayed)
    assert torch.equal(net.weight, values["weight"]) and not net.bias.is_meta


def test_what_changes_nothing_after_the_block_still_materializes() -> None:
    """Flags, optimizers and a forward on meta inputs (a training BatchNorm counts its
    batches in place) after the block are not changes of values."""
    eager = _eager(Mixed)
    net = _deferred(Mixed)
    net.w1.requires_grad_(False)
    torch.optim.AdamW(net.parameters())
    net.bn(torch.empty(2, 4, device="meta"))
    net.bn(torch.empty(2, 4, device="meta"))
    materialize(net)
    _assert_identical(eager, net)


def test_init_functions_that_skip_meta_are_restored_after_the_block() -> None:
    original = nn.init.trunc_normal_
    with no_init_parameters():
        assert nn.init.trunc_normal_ is not original
    assert nn.init.trunc_normal_ is original


def test_hugging_face_models_keep_their_own_initialization() -> None:
    """Hugging Face's ``PreTrainedModel`` runs its ``_init_weights`` (embeddings with std 0.02,
    GPT-2's scaled residual projections) only when ``torch.tensor([])`` does not land on meta;
    the block made that probe meta, so a model built in it kept torch's default init (an
    embedding std of 1, no error). Materialized, it equals the model built eagerly, bit for bit.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def gpt2() -> nn.Module:
        return GPT2LMHeadModel(
            GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4)
        )

    def llama() -> nn.Module:
        cfg = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        return LlamaForCausalLM(cfg)

    for build in (gpt2, llama):
        torch.manual_seed(0)
        eager = build()
        torch.manual_seed(0)
        with no_init_parameters():
            late = build()
        materialize(late)
        for (name, want), (_, got) in zip(
            eager.state_dict().items(), late.state_dict().items(), strict=True
        ):
            assert torch.equal(got, want), f"{build.__name__} {name}"
    with no_init_parameters():  # (the probe itself: a real empty tensor, on the asked device)
        probe = torch.tensor([])
        made = torch.zeros(0, 4)
    assert not probe.is_meta and probe.device == torch.get_default_device()
    assert not made.is_meta and made.shape == (0, 4)
