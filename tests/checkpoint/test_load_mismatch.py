"""Checkpoints that do not fit the network they are loaded into: refused before anything is
copied (network and optimizer untouched), naming the entries, both shapes or values, and the
fix.

Covered: optimizer state of other shapes than its parameters (one rank's file of a
distributed checkpoint loaded into a whole network; a checkpoint of the network in another
size; a file whose state and weights disagree, through load_distributed), with factored state
(Adafactor) and LBFGS's state flattened over all the parameters still loading; a tied tensor
saved under one of its names loading strictly; a checkpoint saved untied whose tied names hold
two values (strict: refused; not strict: the tensor's first name wins); load_param_into_net
refusing an entry of another shape before copying the others; optimizer state saved by
position (from a state_dict) loaded with net= (the positions are named); a tied checkpoint's
optimizer state loaded into the untied network (the tie is named); a strict load_distributed
into a network without a buffer the checkpoint holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

import shardwise as sw
from shardwise.checkpoint import CheckpointStrategy
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner import ParamPlan


def _stepped(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    net(x).sum().backward()
    opt.step()
    opt.zero_grad()


def _state_of(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items()}


def _same(net: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_a_rank_files_optimizer_state_into_a_whole_network_names_the_fix(tmp_path: Path) -> None:
    """The rank's (4, 4) momentum block was put on the whole (8, 4) weight; step() then failed
    with a bare torch size error."""
    torch.manual_seed(0)
    net = nn.Linear(4, 8)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _stepped(net, opt, torch.randn(2, 4))
    sw.save_checkpoint(net, tmp_path / "one" / "c.safetensors", optimizer=opt)
    m = DeviceMatrix((2,), ("mp",))
    rows = CheckpointStrategy(2, m, {"weight": ParamPlan(TensorLayout(m, ((0,), ())), (8, 4))})
    sw.checkpoint.transform(tmp_path / "one", tmp_path / "two", rows)
    part = sw.load_checkpoint(tmp_path / "two" / "rank_1" / "c.safetensors")
    fresh = nn.Linear(4, 8)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError) as refused:
        sw.checkpoint.load_optimizer_state(fresh_opt, part, fresh)
    message = str(refused.value)
    for word in (
        "'optimizer.state.weight.momentum_buffer' of 'weight'",
        "checkpoint shape [4, 4] != parameter shape [8, 4]",
        "it holds [4:8, 0:4] of [8, 4]",
        f"sw.checkpoint.load_distributed(net, {str(tmp_path / 'two')!r}, optimizer)",
    ):
        assert word in message, (word, message)
    assert not fresh_opt.state
    whole = sw.checkpoint.load_distributed(fresh, tmp_path / "two", fresh_opt)  # (the fix)
    assert whole == ([], []) and torch.equal(
        fresh_opt.state[fresh.weight]["momentum_buffer"],
        opt.state[net.weight]["momentum_buffer"],
    )


def test_optimizer_state_of_a_network_in_another_size_is_refused(tmp_path: Path) -> None:
    """Adam's (6, 4) exp_avg was loaded onto a (3, 4) weight without a word."""
    big = nn.Linear(4, 6)
    big_opt = torch.optim.Adam(big.parameters())
    _stepped(big, big_opt, torch.randn(2, 4))
    sw.save_checkpoint(big, tmp_path / "a.safetensors", optimizer=big_opt)
    ckpt = sw.load_checkpoint(tmp_path / "a.safetensors")
    small = nn.Linear(4, 3)
    small_opt = torch.optim.Adam(small.parameters())
    with pytest.raises(
        ValueError,
        match=r"exp_avg' of 'weight': checkpoint shape \[6, 4\] != .*"
        r"\[3, 4\]; a checkpoint of another network",
    ):
        sw.checkpoint.load_optimizer_state(small_opt, ckpt, small)
    assert not small_opt.state


def test_load_distributed_refuses_state_that_does_not_fit_before_loading(tmp_path: Path) -> None:
    """A file whose weights fit the network but whose optimizer state does not: the weights
    were loaded, then the state put on the parameters as it was."""
    big = nn.Linear(4, 6)
    big_opt = torch.optim.SGD(big.parameters(), lr=0.1, momentum=0.9)
    _stepped(big, big_opt, torch.randn(2, 4))
    path = sw.save_checkpoint(big, tmp_path / "c.safetensors", optimizer=big_opt)
    with safetensors.safe_open(path, "pt") as f:
        metadata = f.metadata()
    entries = safetensors.torch.load_file(path)
    entries |= {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}  # (weights of another size)
    safetensors.torch.save_file(entries, path, metadata)
    small = nn.Linear(4, 3)
    small_opt = torch.optim.SGD(small.parameters(), lr=0.1, momentum=0.9)
    before = _state_of(small)
    shapes = r"momentum_buffer' of 'bias': checkpoint shape \[6\] != parameter shape \[3\]"
    with pytest.raises(ValueError, match=shapes):
        sw.checkpoint.load_distributed(small, path, small_opt)
    assert _same(small, before) and not small_opt.state


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch without Adafactor")
def test_factored_optimizer_state_still_loads(tmp_path: Path) -> None:
    net = nn.Linear(4, 6)
    opt = torch.optim.Adafactor(net.parameters())  # type: ignore[attr-defined]
    _stepped(net, opt, torch.randn(2, 4))
    sw.save_checkpoint(net, tmp_path / "c.safetensors", optimizer=opt)
    fresh = nn.Linear(4, 6)
    fresh_opt = torch.optim.Adafactor(fresh.parameters())  # type: ignore[attr-defined]
    sw.checkpoint.load_distributed(fresh, tmp_path / "c.safetensors", fresh_opt)
    assert torch.equal(fresh_opt.state[fresh.weight]["row_var"], opt.state[net.weight]["row_var"])


def _lbfgs(out: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, out))
    return net, torch.optim.LBFGS(net.parameters(), lr=0.5, history_size=3, max_iter=2)


def _lbfgs_losses(net: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        return loss

    return [opt.step(closure).detach().item() for _ in range(steps)]  # type: ignore[union-attr]


def test_lbfgs_state_flattened_over_the_parameters_resumes_as_torch(tmp_path: Path) -> None:
    """LBFGS keeps its direction and last gradient flattened over all the parameters in the
    first parameter's state: that [18] state of a LayerNorm's [4] weight was refused as a
    checkpoint of another network (torch's load_state_dict resumes it)."""
    net, opt = _lbfgs()
    want = _lbfgs_losses(net, opt, 4)
    net, opt = _lbfgs()
    _lbfgs_losses(net, opt, 2)
    path = sw.save_checkpoint(net, tmp_path / "c.safetensors", optimizer=opt)
    fresh, fresh_opt = _lbfgs()
    sw.load_param_into_net(fresh, sw.load_checkpoint(path), strict_load=True)
    sw.checkpoint.load_optimizer_state(fresh_opt, sw.load_checkpoint(path), fresh)
    assert _lbfgs_losses(fresh, fresh_opt, 2) == want[2:]
    fresh, fresh_opt = _lbfgs()
    assert sw.checkpoint.load_distributed(fresh, path, fresh_opt) == ([], [])
    assert _lbfgs_losses(fresh, fresh_opt, 2) == want[2:]
    other, other_opt = _lbfgs(out=3)  # (another network: its flattened size is 23)
    refused = r"\.d' of '0.weight': checkpoint shape \[18\] != flattened .* \[23\]"
    with pytest.raises(ValueError, match=refused):
        sw.checkpoint.load_optimizer_state(other_opt, sw.load_checkpoint(path), other)
    assert not other_opt.state


def test_optimizer_saved_from_a_state_dict_loaded_with_net_names_the_positions(
    tmp_path: Path,
) -> None:
    """A state_dict's tensors are copies: the optimizer's parameters are saved by position,
    and loading with net= blamed requires_grad ("frozen here?")."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(net.parameters())
    _stepped(net, opt, torch.randn(3, 4))
    path = sw.save_checkpoint(net.state_dict(), tmp_path / "c.safetensors", optimizer=opt)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fresh_opt = torch.optim.Adam(fresh.parameters())
    with pytest.raises(ValueError) as refused:
        sw.checkpoint.load_optimizer_state(fresh_opt, sw.load_checkpoint(path), fresh)
    message = str(refused.value)
    assert "names the optimizer's parameters by position ('0', '1', '2', '3')" in message
    assert "load_optimizer_state(optimizer, ckpt) without net=" in message
    assert "frozen" not in message and not fresh_opt.state
    sw.checkpoint.load_optimizer_state(fresh_opt, sw.load_checkpoint(path))  # (the fix)
    assert torch.equal(fresh_opt.state[fresh[1].bias]["exp_avg"], opt.state[net[1].bias]["exp_avg"])


@pytest.mark.parametrize("strict", [False, True])
def test_load_param_into_net_checks_every_shape_before_copying(strict: bool) -> None:
    """'0.weight' was copied before '1.weight' of another shape was refused: half loaded."""
    saved = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ckpt = {k: v.detach().clone() for k, v in saved.state_dict().items()}
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    before = _state_of(net)
    refused = r"'1.weight': checkpoint shape \[4, 4\] != network shape \[3, 4\].*nothing was loaded"
    with pytest.raises(ValueError, match=refused):
        sw.load_param_into_net(net, ckpt, strict_load=strict)
    assert _same(net, before)


class LM(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def test_an_untied_checkpoint_into_the_tied_network(tmp_path: Path) -> None:
    """Strict loads returned ([], []) and silently kept one of the two values."""
    torch.manual_seed(0)
    path = sw.save_checkpoint(LM(tie=False), tmp_path / "untied.safetensors")
    ckpt = sw.load_checkpoint(path)
    tied = LM(tie=True)
    before = _state_of(tied)
    words = r"entries 'emb.weight' and 'head.weight' hold different values, but the network ties"
    with pytest.raises(ValueError, match=words + r".*strict_load=False, which keeps 'emb.weight'"):
        sw.load_param_into_net(tied, ckpt, strict_load=True)
    assert _same(tied, before)
    with pytest.raises(ValueError, match=words + r".*strict=False, which keeps 'emb.weight'"):
        sw.checkpoint.load_distributed(tied, path)
    assert _same(tied, before)
    assert sw.load_param_into_net(tied, ckpt) == ([], [])  # (not strict: the first name wins)
    assert torch.equal(tied.emb.weight, ckpt["emb.weight"])
    same = LM(tie=True)  # (a tied checkpoint: one value under both names)
    sw.save_checkpoint(same, tmp_path / "tied.safetensors")
    assert sw.checkpoint.load_distributed(LM(tie=True), tmp_path / "tied.safetensors") == ([], [])


def test_a_tied_weight_holding_a_nan_reloads_strictly(tmp_path: Path) -> None:
    """Its two names' entries hold one value, NaN included: not refused as saved untied."""
    torch.manual_seed(0)
    saved = LM(tie=True)
    with torch.no_grad():
        saved.emb.weight[0, 0] = float("nan")
    path = sw.save_checkpoint(saved, tmp_path / "nan.safetensors")
    for load in (
        lambda net: sw.load_param_into_net(net, sw.load_checkpoint(path), strict_load=True),
        lambda net: sw.checkpoint.load_distributed(net, path),
    ):
        net = LM(tie=True)
        assert load(net) == ([], [])
        assert torch.equal(net.head.weight.isnan(), saved.emb.weight.isnan())
        assert torch.equal(net.head.weight.nan_to_num(), saved.emb.weight.nan_to_num())


@pytest.mark.parametrize("held", ["emb.weight", "head.weight"])
def test_a_tied_tensor_saved_under_one_of_its_names_loads_strictly(
    tmp_path: Path, held: str
) -> None:
    """A file without the tied head (Hugging Face GPT-2 files omit lm_head.weight):
    load_param_into_net(strict_load=True) loaded it, load_distributed (strict) refused it as
    a checkpoint of another network."""
    torch.manual_seed(0)
    saved = LM(tie=True)
    path = sw.save_checkpoint({held: saved.emb.weight}, tmp_path / "c.safetensors")
    net = LM(tie=True)
    assert sw.checkpoint.load_distributed(net, path) == ([], [])
    assert torch.equal(net.head.weight, saved.emb.weight) and net.head.weight is net.emb.weight
    with pytest.raises(ValueError, match=r"LM\.\w+\.weight \[10, 4\] is not in the checkpoint"):
        sw.checkpoint.load_distributed(LM(tie=False), path)  # (untied: a tensor is missing)


def _optimizer_loads_refused(tmp_path: Path, saved_tie: bool) -> tuple[Any, Any, Any, list[str]]:
    """Save a stepped ``LM(tie=saved_tie)`` with its optimizer's state, load that state into a
    fresh ``LM(tie=not saved_tie)``'s optimizer both ways (`load_distributed` and
    `load_optimizer_state`), each refused: (that network, its optimizer, its state before the
    loads, the two refusals' messages)."""
    saved = LM(tie=saved_tie)
    opt = torch.optim.SGD(saved.parameters(), lr=0.1, momentum=0.9)
    _stepped(saved, opt, torch.tensor([1, 2]))
    path = sw.save_checkpoint(saved, tmp_path / "saved.safetensors", optimizer=opt)
    net = LM(tie=not saved_tie)
    net_opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    before = _state_of(net)
    messages = []
    for load in (
        lambda: sw.checkpoint.load_distributed(net, path, net_opt),
        lambda: sw.checkpoint.load_optimizer_state(net_opt, sw.load_checkpoint(path), net),
    ):
        with pytest.raises(ValueError) as refused:
            load()
        messages.append(str(refused.value))
    return net, net_opt, before, messages


def test_a_tied_checkpoints_optimizer_into_the_untied_network_names_the_tie(
    tmp_path: Path,
) -> None:
    """The message blamed requires_grad ("frozen when saved?")."""
    untied, untied_opt, before, messages = _optimizer_loads_refused(tmp_path, saved_tie=True)
    for message in messages:
        assert "'head.weight' is in this optimizer's group 0 but was tied to 'emb.weight'" in (
            message
        )
        assert "tie them as the saving job did" in message
        assert "frozen" not in message and "requires_grad" not in message
        assert _same(untied, before) and not untied_opt.state


def test_an_untied_checkpoints_optimizer_into_the_tied_network_names_the_tie(
    tmp_path: Path,
) -> None:
    """The other way round: the message said "frozen here?"."""
    _, tied_opt, _, messages = _optimizer_loads_refused(tmp_path, saved_tie=False)
    for message in messages:
        assert "'head.weight' was saved as a parameter of its own" in message
        assert "this network ties it to 'emb.weight': untie them as the saving job did" in message
        assert "frozen" not in message and not tied_opt.state


def test_strict_load_distributed_without_a_buffer_of_the_checkpoint_names_the_fix(
    tmp_path: Path,
) -> None:
    net = nn.BatchNorm1d(3)
    path = sw.save_checkpoint(net, tmp_path / "bn.safetensors")
    fresh = nn.BatchNorm1d(3)
    del fresh._buffers["num_batches_tracked"]
    with pytest.raises(ValueError) as refused:
        sw.checkpoint.load_distributed(fresh, path)
    message = str(refused.value)
    assert "checkpoint entry 'num_batches_tracked' is not in BatchNorm1d" in message
    assert "a checkpoint of another network? strict=False loads the rest" in message
    assert sw.checkpoint.load_distributed(fresh, path, strict=False) == (
        [],
        ["num_batches_tracked"],
    )
