"""torch DCP interop in both directions, against what torch's own APIs save and load.

shardwise -> torch: a 4-rank shardwise checkpoint (tensor parallel, optimizer parallel with
padding, a strided layout) exported with `export_dcp` is loaded by torch's ``dcp.load`` into
plain tensors (``no_dist``, in this process) and, on 2 real gloo ranks, into an FSDP2 model and
Adam and into ``Shard(-1)`` DTensors (dcp_worker.py); values are equal exactly and the next
step's loss is the one-device loss. torch -> shardwise: what FSDP2 + ``dcp.save`` wrote on
those ranks (both optimizer layouts) is imported for one device and for 2 ranks, equal exactly,
and a plain model and Adam loaded from it continue with torch's own next loss.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import shardwise as sw
from shardwise.checkpoint import (
    CheckpointError,
    CheckpointStrategy,
    ShardSpec,
    export_dcp,
    import_dcp,
    merge,
    transform,
)
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner import ParamPlan
from shardwise.testing import run_job

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import dcp_worker as w  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def four_ranks() -> CheckpointStrategy:
    """dp x mp = 2 x 2: columns over mp, rows over dp by optimizer parallel (padded for 3
    rows), a strided bias (5 groups of 2 over mp), the last bias whole."""
    m = DeviceMatrix((2, 2), ("dp", "mp"))
    params = {
        "0.weight": ParamPlan(TensorLayout(m, ((), (1,))), (10, 6)),
        "0.bias": ParamPlan(TensorLayout(m, ((1,),), groups=(5,)), (10,)),
        "2.weight": ParamPlan(TensorLayout(m, ((), (1,))), (3, 10)),
    }
    shards = {"0.weight": ShardSpec(("dp",), 2), "2.weight": ShardSpec(("dp",), 2, pad=True)}
    return CheckpointStrategy(4, m, params, shards)


def two_ranks() -> CheckpointStrategy:
    m = DeviceMatrix((2,), ("mp",))
    return CheckpointStrategy(2, m, {"0.weight": ParamPlan(TensorLayout(m, ((0,), ())), (10, 6))})


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A one-device model (other values than the checkpoint's) and a fresh Adam."""
    net = w.network(7)
    opt = torch.optim.Adam(net.parameters(), lr=w.LR)
    return net, opt


def shardwise_checkpoint(root: Path) -> tuple[Path, dict[str, torch.Tensor], float]:
    """A 4-rank checkpoint of the model and Adam after one step; its full values; the loss
    after one more step on one device."""
    net = w.network(0)
    opt = torch.optim.Adam(net.parameters(), lr=w.LR)
    w.step(net, opt)
    sw.save_checkpoint(net, root / "one.safetensors", optimizer=opt)
    full = dict(net.state_dict())
    for i, name in enumerate(n for n, _ in net.named_parameters()):
        full |= {f"optimizer.state.{name}.{k}": v for k, v in opt.state_dict()["state"][i].items()}
    full = {k: v.detach().clone() for k, v in full.items()}
    transform(root / "one.safetensors", root / "four", four_ranks())
    w.step(net, opt)
    return root / "four", full, w.loss(net)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank torch job's folder, after it saved and loaded (one launch for all tests)."""
    out = tmp_path_factory.mktemp("dcp")
    four, full, after = shardwise_checkpoint(out)
    export_dcp(four, out / "shardwise_dcp", model_key="model")
    safetensors.torch.save_file(full, out / "shardwise_full.safetensors")
    (out / "shardwise_loss.json").write_text(json.dumps(after.hex()))
    res = run_job(HERE / "dcp_worker.py", 2, out / "logs", str(out), timeout=150)
    res.assert_checks(2, ["save", "load_fsdp2", "continue", "load_dtensor"])
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_torch_fsdp2_and_dtensors_load_an_export(job: Path) -> None:
    assert (job / "shardwise_dcp" / ".metadata").is_file()  # (the worker's checks passed)


def continue_from(merged: Path) -> float:
    ckpt = sw.load_checkpoint(merged)
    net, opt = fresh()
    net.load_state_dict(dict(ckpt))
    sw.checkpoint.load_optimizer_state(opt, ckpt, net)
    w.step(net, opt)
    return w.loss(net)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_import_fsdp2_checkpoint_for_one_device(job: Path, tmp_path: Path) -> None:
    want = safetensors.torch.load_file(job / "torch_full.safetensors")
    import_dcp(job / "torch_nested", tmp_path / "one", model_key="model",
               optimizer_class=torch.optim.Adam)  # fmt: skip
    merge(tmp_path / "one", tmp_path / "m.safetensors", optimizer=True)
    got = safetensors.torch.load_file(tmp_path / "m.safetensors")
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    torch_loss = float.fromhex(json.loads((job / "torch_loss.json").read_text()))
    assert continue_from(tmp_path / "m.safetensors") == torch_loss


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_import_torchtitan_layout_for_two_ranks(job: Path, tmp_path: Path) -> None:
    want = safetensors.torch.load_file(job / "torch_full.safetensors")
    import_dcp(job / "torch_flat", tmp_path / "two", two_ranks(), optimizer_class="Adam")
    block = sw.load_checkpoint(tmp_path / "two" / "rank_1" / "checkpoint.safetensors")
    assert torch.equal(block["0.weight"], want["0.weight"][5:])
    net, opt = fresh()
    assert sw.checkpoint.load_distributed(net, tmp_path / "two", opt) == ([], [])
    w.step(net, opt)
    assert w.loss(net) == float.fromhex(json.loads((job / "torch_loss.json").read_text()))


def test_export_loads_as_plain_tensors_and_optimizer(tmp_path: Path) -> None:
    four, full, after = shardwise_checkpoint(tmp_path)
    for flatten in (False, True):
        out = tmp_path / f"dcp_{flatten}"
        export_dcp(four, out, flatten_optimizer=flatten)
        net, opt = fresh()
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        msd = get_model_state_dict(net)
        osd = get_optimizer_state_dict(net, opt, options=options)
        dcp.load({**msd, "optimizer": osd}, checkpoint_id=out, no_dist=True)
        set_model_state_dict(net, msd)
        set_optimizer_state_dict(net, opt, osd, options=options)
        for k, v in net.state_dict().items():
            assert torch.equal(v, full[k]), k
        w.step(net, opt)
        assert w.loss(net) == after


def test_export_import_round_trip_is_exact(tmp_path: Path) -> None:
    four, full, _ = shardwise_checkpoint(tmp_path)
    export_dcp(four, tmp_path / "dcp", model_key="model", optimizer_key="optim")
    import_dcp(tmp_path / "dcp", tmp_path / "back", four_ranks(), model_key="model",
               optimizer_key="optim", optimizer_class=torch.optim.Adam)  # fmt: skip
    for r in range(4):
        a = safetensors.torch.load_file(four / f"rank_{r}" / "one.safetensors")
        b = safetensors.torch.load_file(tmp_path / "back" / f"rank_{r}" / "checkpoint.safetensors")
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (r, k)
    import_dcp(tmp_path / "dcp", tmp_path / "model_only", model_key="model", optimizer=False)
    ckpt = sw.load_checkpoint(tmp_path / "model_only" / "checkpoint.safetensors")
    assert ckpt.optimizer_state is None
    assert set(ckpt) == {k for k in full if not k.startswith("optimizer.")}


def test_a_zero_element_entry_is_exported_as_torch_saves_it(tmp_path: Path) -> None:
    """An entry with no elements (a buffer of shape (0, 4)) is one empty chunk in the export,
    as torch's ``dcp.save`` writes it: torch loads the export and `import_dcp` gives it back."""
    net = torch.nn.Linear(4, 2)
    net.register_buffer("cache", torch.zeros(0, 4))
    sw.save_checkpoint(net, tmp_path / "one" / "c.safetensors")
    transform(tmp_path / "one", tmp_path / "two", 2)
    export_dcp(tmp_path / "two", tmp_path / "dcp")
    dcp.save(dict(net.state_dict()), checkpoint_id=tmp_path / "torch", no_dist=True)
    ours = dcp.FileSystemReader(tmp_path / "dcp").read_metadata().state_dict_metadata
    theirs = dcp.FileSystemReader(tmp_path / "torch").read_metadata().state_dict_metadata
    assert ours["cache"] == theirs["cache"]
    loaded = {k: torch.ones_like(v) for k, v in net.state_dict().items()}
    dcp.load(loaded, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in loaded.items())
    import_dcp(tmp_path / "dcp", tmp_path / "back", optimizer=False)
    back = safetensors.torch.load_file(tmp_path / "back" / "checkpoint.safetensors")
    assert back.keys() == net.state_dict().keys()
    assert back["cache"].shape == (0, 4) and back["cache"].dtype == torch.float32


def test_errors_name_the_problem(tmp_path: Path) -> None:
    four, _, _ = shardwise_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        import_dcp(tmp_path / "absent", tmp_path / "x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no \.metadata"):
        import_dcp(tmp_path / "empty", tmp_path / "x")
    export_dcp(four, tmp_path / "dcp")
    with pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
        export_dcp(four, tmp_path / "dcp")
    with pytest.raises(CheckpointError, match="optimizer_class="):
        import_dcp(tmp_path / "dcp", tmp_path / "x")
    import_dcp(tmp_path / "dcp", tmp_path / "x", optimizer=False)
    with pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
        import_dcp(tmp_path / "dcp", tmp_path / "x", optimizer=False)
    with pytest.raises(CheckpointError, match="model_key="):
        import_dcp(tmp_path / "dcp", tmp_path / "y", model_key="model", optimizer=False)
    (tmp_path / "dcp" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="not readable DCP metadata"):
        import_dcp(tmp_path / "dcp", tmp_path / "z")
    assert not (tmp_path / "z").exists()


def through_flat_dcp(
    tmp_path: Path,
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
    make: Callable[[], torch.optim.Optimizer],
) -> torch.optim.Optimizer:
    """`opt` saved with `net`, exported in torchtitan's per-parameter layout, imported back
    and loaded into a fresh optimizer of `make`."""
    sw.save_checkpoint(net, tmp_path / "ck.safetensors", optimizer=opt)
    export_dcp(tmp_path / "ck.safetensors", tmp_path / "dcp", flatten_optimizer=True)
    import_dcp(tmp_path / "dcp", tmp_path / "back", optimizer_class=torch.optim.Adam)
    back = make()
    ckpt = sw.load_checkpoint(tmp_path / "back" / "checkpoint.safetensors")
    sw.checkpoint.load_optimizer_state(back, ckpt, net)
    return back


def test_per_parameter_groups_load_into_the_optimizer_they_came_from(tmp_path: Path) -> None:
    """torchtitan's layout keeps one group per parameter; they come back grouped by their
    hyperparameters in DCP's key order (bias before weight), and each of the optimizer's
    groups takes the saved group holding its parameters: the next step is the uninterrupted
    one."""
    torch.manual_seed(0)
    net, x = torch.nn.Linear(4, 2), torch.randn(3, 4)

    def adam() -> torch.optim.Optimizer:
        return torch.optim.Adam([{"params": [net.weight], "lr": 0.1},
                                 {"params": [net.bias], "lr": 0.01}])  # fmt: skip

    opt = adam()
    net(x).sum().backward()
    opt.step()
    back = through_flat_dcp(tmp_path, net, opt, adam)
    assert [g["lr"] for g in back.param_groups] == [0.1, 0.01]
    before = [p.detach().clone() for p in net.parameters()]
    for o in (opt, back):
        with torch.no_grad():
            for p, b in zip(net.parameters(), before, strict=True):
                p.copy_(b)
        o.zero_grad()
        net(x).sum().backward()
        o.step()
        if o is opt:
            want = [p.detach().clone() for p in net.parameters()]
    assert all(torch.equal(p, w) for p, w in zip(net.parameters(), want, strict=True))


def test_a_corrupt_source_is_a_checkpoint_error(tmp_path: Path) -> None:
    """torch's save wraps what a read raised in its CheckpointException (a BaseException):
    the export raises the read's own error, naming the file and the entry."""
    net = torch.nn.Linear(4, 2)
    path = sw.save_checkpoint(net, tmp_path / "good" / "ck.safetensors")
    data = bytearray(Path(path).read_bytes())
    data[-5] ^= 0xFF
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "ck.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"ck.safetensors: tensor '\w+' is corrupt"):
        export_dcp(tmp_path / "bad", tmp_path / "dcp")
    assert not (tmp_path / "dcp").exists()


def test_two_groups_with_the_same_parameters_keep_their_own_settings(tmp_path: Path) -> None:
    """Two empty groups (torch allows them) each take their own saved settings, in order."""
    net = torch.nn.Linear(4, 2)

    def adam() -> torch.optim.Optimizer:
        return torch.optim.Adam([{"params": list(net.parameters()), "lr": 0.1},
                                 {"params": [], "lr": 0.2}, {"params": [], "lr": 0.3}])  # fmt: skip

    opt = adam()
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    sw.save_checkpoint(net, tmp_path / "ck.safetensors", optimizer=opt)
    back = adam()
    for g in back.param_groups:
        g["lr"] = 0.0
    sw.checkpoint.load_optimizer_state(back, sw.load_checkpoint(tmp_path / "ck.safetensors"), net)
    assert [g["lr"] for g in back.param_groups] == [0.1, 0.2, 0.3]


def test_empty_groups_survive_the_per_parameter_layout(tmp_path: Path) -> None:
    """torchtitan's per-parameter groups cannot record an empty group: one the optimizer has
    and no saved group matches keeps its own settings (the load failed: '1 parameter groups
    saved, the optimizer has 3')."""
    net = torch.nn.Linear(4, 2)

    def adam() -> torch.optim.Optimizer:
        return torch.optim.Adam([{"params": [], "lr": 0.3}, {"params": list(net.parameters())},
                                 {"params": [], "lr": 0.4}])  # fmt: skip

    opt = adam()
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    back = through_flat_dcp(tmp_path, net, opt, adam)
    assert [g["lr"] for g in back.param_groups] == [0.3, 0.001, 0.4]
    assert torch.equal(back.state[net.weight]["exp_avg"], opt.state[net.weight]["exp_avg"])
