"""save_checkpoint / load_checkpoint / load_param_into_net: forms, metadata, safety."""

from __future__ import annotations

import gc
import os
import pickle
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from shardwise.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    load_param_into_net,
    save_checkpoint,
)
from shardwise.parameter import Parameter, initializer, no_init_parameters


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.w = Parameter(initializer("normal", [3, 2]), name="w")


def _equal_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_module_round_trip_with_metadata(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    net.bn.running_mean.add_(1.5)
    path = save_checkpoint(net, tmp_path / "net.safetensors", step=7, epoch=2, extra={"a": [1]})
    assert path == tmp_path / "net.safetensors"
    ckpt = load_checkpoint(path)
    assert isinstance(ckpt, Checkpoint) and isinstance(ckpt, dict)
    assert (ckpt.step, ckpt.epoch, ckpt.extra, ckpt.path) == (7, 2, {"a": [1]}, path)
    assert ckpt.optimizer_state is None
    assert set(ckpt) == set(net.state_dict())
    fresh = Net()
    assert load_param_into_net(fresh, ckpt) == ([], [])
    assert _equal_state(net, fresh)


def test_dict_and_list_forms(tmp_path: Path) -> None:
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(2, dtype=torch.bfloat16)
    save_checkpoint({"a": a, "b": b}, tmp_path / "d.safetensors")
    save_checkpoint(
        [{"name": "a", "data": a}, {"name": "b", "data": b}], tmp_path / "l.safetensors"
    )
    for name in ("d", "l"):
        ckpt = load_checkpoint(tmp_path / f"{name}.safetensors")
        assert torch.equal(ckpt["a"], a) and torch.equal(ckpt["b"], b)
        assert ckpt["b"].dtype == torch.bfloat16
        assert ckpt.step is None and ckpt.epoch is None and ckpt.extra is None


def test_shared_and_non_contiguous_tensors_are_stored(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    tied = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    tied[1].weight = tied[0].weight
    save_checkpoint({"t": base.t(), "row": base[1], "all": base}, tmp_path / "v.safetensors")
    ckpt = load_checkpoint(tmp_path / "v.safetensors")
    assert torch.equal(ckpt["t"], base.t()) and torch.equal(ckpt["row"], base[1])
    save_checkpoint(tied, tmp_path / "tied.safetensors")
    ckpt = load_checkpoint(tmp_path / "tied.safetensors")
    assert set(ckpt) == {"0.weight", "1.weight"}
    del ckpt["1.weight"]  # a tied weight loaded under one name counts for both
    assert load_param_into_net(tied, ckpt) == ([], [])


def test_save_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        save_checkpoint(42, tmp_path / "x.safetensors")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint({"a": torch.ones(1)}, tmp_path / "x.safetensors", extra={"f": object()})
    with pytest.raises(ValueError, match="step"):
        save_checkpoint({"a": torch.ones(1)}, tmp_path / "x.safetensors", step=-1)
    with no_init_parameters():
        deferred = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="meta"):
        save_checkpoint(deferred, tmp_path / "x.safetensors")
    sparse = {"emb.mask": torch.eye(3).to_sparse()}
    with pytest.raises(TypeError, match=r"entry 'emb.mask' is a torch.sparse_coo .*\.to_dense\(\)"):
        save_checkpoint(sparse, tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir())


def test_truncated_or_corrupt_files_are_rejected_and_previous_survives(tmp_path: Path) -> None:
    net = Net()
    old = save_checkpoint(net, tmp_path / "checkpoint-1_1.safetensors")
    new = save_checkpoint(net, tmp_path / "checkpoint-1_2.safetensors")
    data = new.read_bytes()
    new.write_bytes(data[: len(data) - 10])
    with pytest.raises(CheckpointError, match=r"checkpoint-1_2\.safetensors.*truncated"):
        load_checkpoint(new)
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF  # inside the last tensor's bytes; the header is intact
    new.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(new)
    assert load_checkpoint(new, verify=False)  # the caller may opt out
    assert set(load_checkpoint(old)) == set(net.state_dict())
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_loading_never_unpickles(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.safetensors"
    evil.write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match="never unpickles"):
        load_checkpoint(evil)
    torch.save({"w": torch.ones(2)}, tmp_path / "torch.safetensors")
    with pytest.raises(CheckpointError, match=r"torch\.safetensors"):
        load_checkpoint(tmp_path / "torch.safetensors")
    assert not marker.exists()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_checkpoint(tmp_path / "missing.safetensors")


def test_a_folder_is_named_as_a_folder(tmp_path: Path) -> None:
    """Loading a distributed checkpoint's folder said "checkpoint file not found"; saving to a
    folder surfaced the IsADirectoryError of the hidden temporary file."""
    save_checkpoint(Net(), tmp_path / "ckpt" / "rank_0" / "c.safetensors")
    with pytest.raises(IsADirectoryError) as refused:
        load_checkpoint(tmp_path / "ckpt")
    message = str(refused.value)
    assert f"{tmp_path / 'ckpt'} is a folder, not a checkpoint file" in message
    for fix in ("load_distributed(net, folder)", "merge(folder, file)", "latest_checkpoint"):
        assert fix in message, (fix, message)
    with pytest.raises(IsADirectoryError, match=r"ckpt is a folder: give the file to write"):
        save_checkpoint(Net(), tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rank_0"]


def test_foreign_safetensors_files_load(tmp_path: Path) -> None:
    safetensors.torch.save_file({"x": torch.ones(2)}, tmp_path / "hf.safetensors")
    ckpt = load_checkpoint(tmp_path / "hf.safetensors")
    assert torch.equal(ckpt["x"], torch.ones(2)) and ckpt.step is None


def test_filter_prefix(tmp_path: Path) -> None:
    save_checkpoint(Net(), tmp_path / "n.safetensors")
    ckpt = load_checkpoint(tmp_path / "n.safetensors", filter_prefix=["bn.", "w"])
    assert set(ckpt) == {"fc.weight", "fc.bias"}


def test_load_param_into_net_reports_both_sides() -> None:
    net = Net()
    params = {"fc.weight": torch.zeros(3, 4), "unknown": torch.ones(1)}
    param_not_load, ckpt_not_load = load_param_into_net(net, params)
    assert ckpt_not_load == ["unknown"]
    assert "fc.bias" in param_not_load and "fc.weight" not in param_not_load
    assert torch.equal(net.fc.weight, torch.zeros(3, 4))


def test_load_param_into_net_suffix_and_dtype_rules() -> None:
    net = Net()
    wrapped = {"network.fc.weight": torch.ones(3, 4, dtype=torch.float64)}
    assert load_param_into_net(net, wrapped, strict_load=True)[1] == ["network.fc.weight"]
    not_loaded, unused = load_param_into_net(net, wrapped)
    assert unused == [] and "fc.weight" not in not_loaded
    assert net.fc.weight.dtype == torch.float32 and torch.equal(net.fc.weight, torch.ones(3, 4))
    with pytest.raises(CheckpointError, match="dtype"):
        load_param_into_net(net, {"fc.weight": torch.ones(3, 4, dtype=torch.float64)}, True)
    with pytest.raises(CheckpointError, match=r"shape \[4, 3\]"):
        load_param_into_net(net, {"fc.weight": torch.ones(4, 3)})
    with pytest.raises(CheckpointError, match=r"\[3, 4\]; a checkpoint of another network"):
        load_param_into_net(net, {"fc.weight": torch.ones(5, 6)})  # (no plan cut it: not a block)
    with pytest.raises(TypeError):
        load_param_into_net("net", {})  # type: ignore[arg-type]


def test_a_suffix_several_network_names_end_with_loads_into_none() -> None:
    """``0.weight`` fits ``a.0.weight`` and ``b.0.weight``: it went into the first (``a``), the
    docs promising a unique suffix; it now goes nowhere and both are reported."""
    net = torch.nn.Module()
    net.a = torch.nn.Sequential(torch.nn.Linear(2, 2))
    net.b = torch.nn.Sequential(torch.nn.Linear(2, 2))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    not_loaded, unused = load_param_into_net(net, {"0.weight": torch.ones(2, 2)})
    assert not_loaded == ["a.0.weight", "a.0.bias", "b.0.weight", "b.0.bias"]
    assert unused == ["0.weight"]
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    not_loaded, unused = load_param_into_net(net, {"b.0.weight": torch.ones(2, 2)})
    assert "b.0.weight" not in not_loaded and unused == []  # (an equal name still loads)
    net.b[0].weight = net.a[0].weight  # (tied: the names of one tensor count as one)
    not_loaded, unused = load_param_into_net(net, {"0.weight": torch.full((2, 2), 3.0)})
    assert unused == [] and bool((net.a[0].weight == 3).all())


def test_loading_into_a_deferred_net_skips_random_init(tmp_path: Path) -> None:
    source = Net()
    ckpt = load_checkpoint(save_checkpoint(source, tmp_path / "s.safetensors"))
    with no_init_parameters():
        net = Net()
        opt = torch.optim.SGD(net.parameters(), 0.1)
    objects = [id(p) for p in net.parameters()]
    assert load_param_into_net(net, ckpt) == ([], [])
    assert _equal_state(source, net)
    assert [id(p) for p in opt.param_groups[0]["params"]] == objects
    assert isinstance(net.w, Parameter) and net.w.name == "w"


def test_a_whole_checkpoint_into_a_planned_network_names_the_fix() -> None:
    """A single-device state loaded with the plain function after the network was planned (its
    column-parallel weight cut to this rank's rows) named only the two shapes. The wrapper is
    a temporary, gone before the load: the network is still known to be stored by its plan
    (`parallel._ownership.stored`; it was forgotten with the wrapper)."""
    import shardwise as sw
    from shardwise.testing import simulated_world

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    whole = {k: v.clone() for k, v in net.state_dict().items()}
    sw.shard(net[0], in_strategy=((1, 1), (2, 1)))
    x = torch.randn(4, 4)
    with simulated_world(2) as world:
        world.replicate(net)
        sw.AutoParallel(net)(world.rows(x))
        gc.collect()
        with pytest.raises(CheckpointError, match=r"block of it .*load_distributed\(net, folder"):
            load_param_into_net(net, whole)
