"""Bad input to transform / merge / transform_checkpoints / load_distributed: a clear
`CheckpointError` naming the problem and the fix, and nothing overwritten.

Covered: missing rank files, a corrupt tensor (checksum), a truncated file, rank files of two
checkpoints mixed, a strategy that does not fit the shapes (or is of another network), an
existing destination (refused without ``overwrite``; replaced only by a complete new one),
a checkpoint of another network (a wrapper's ``network.`` names are not another network's),
optimizer state whose parameter groups differ and a strict dtype difference (refused with the
network and the optimizer untouched), and rank files of a tied weight that do not record their cut
(merged by the job's parameter strategy file, which records the tie; refused with the cause
by a file without it). The destination is checked byte for byte (absent, or
its old content) and no hidden partial output is left next to it.
"""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from tests.checkpoint.ckpt_cases import (
    SHAPES,
    Net,
    hidden,
    merged,
    snapshot,
    source,
    split,
    tensors,
)
from tests.zoo import TiedHead
from torch import nn

import shardwise as sw
from shardwise import communication as comm
from shardwise.checkpoint import CheckpointError, CheckpointStrategy, ShardSpec
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner import ParamPlan
from shardwise.testing import simulated_world

APIS = ("transform", "merge", "transform_checkpoints", "load_distributed")


def _call(api: str, src: Path, dst: Path, net: Net) -> Callable[[], object]:
    return {
        "transform": lambda: sw.checkpoint.transform(src, dst, 2),
        "merge": lambda: sw.checkpoint.merge(src, dst),
        "transform_checkpoints": lambda: sw.transform_checkpoints(src, dst, "ck_"),
        "load_distributed": lambda: sw.checkpoint.load_distributed(net, src),
    }[api]


def _refused(api: str, src: Path, dst: Path, *words: str) -> str:
    """Run `api`; it must raise `CheckpointError` naming every word, leave `dst` absent and
    nothing hidden next to it (a load_distributed network: untouched when the error comes
    before any tensor is read)."""
    net = Net()
    with pytest.raises(CheckpointError) as info:
        _call(api, src, dst, net)()
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    assert not dst.exists() and hidden(dst.parent) == [] and net.unchanged()
    return message


def _entry_offset(path: Path, key: str) -> int:
    """Where entry `key`'s bytes start in the safetensors file `path`."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return 8 + n + json.loads(data[8 : 8 + n])[key]["data_offsets"][0]


def _corrupt(path: Path, key: str) -> None:
    data = bytearray(path.read_bytes())
    data[_entry_offset(path, key) + 5] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("api", APIS)
def test_missing_rank_files_are_named(api: str, tmp_path: Path) -> None:
    src = source(tmp_path / "s")
    for r in (1, 3):
        shutil.rmtree(src / f"rank_{r}")
    msg = _refused(api, src, tmp_path / "out" / "dst", "4 ranks", "rank_1, rank_3", str(src))
    assert "rank_0 ... rank_3" in msg  # what the folder needs


@pytest.mark.parametrize("api", APIS[:3])
def test_a_corrupt_tensor_names_its_key_and_file(api: str, tmp_path: Path) -> None:
    src = source(tmp_path / "s")
    _corrupt(src / "rank_2" / "whole.safetensors", "q")
    where = str(src / "rank_2" / "whole.safetensors")
    _refused(api, src, tmp_path / "out" / "dst", where, "'q'", "checksum", "restore")


def test_load_distributed_of_a_corrupt_file_names_it(tmp_path: Path) -> None:
    src = source(tmp_path / "s")
    last = list(Net().state_dict())[-1]  # (loaded last: every other entry would load first)
    _corrupt(src / "rank_1" / "whole.safetensors", last)
    net = Net()
    with pytest.raises(CheckpointError, match=rf"rank_1/whole.safetensors: tensor '{last}' is"):
        sw.checkpoint.load_distributed(net, src)
    assert net.unchanged()  # every block is checked before anything is loaded


@pytest.mark.parametrize("api", APIS)
def test_a_truncated_file_is_refused_before_anything_is_read(api: str, tmp_path: Path) -> None:
    src = source(tmp_path / "s")
    path = src / "rank_3" / "whole.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    _refused(api, src, tmp_path / "out" / "dst", str(path), "truncated", "copy it again")


@pytest.mark.parametrize("api", APIS)
def test_rank_files_of_two_saves_mixed_are_refused(api: str, tmp_path: Path) -> None:
    src = source(tmp_path / "s", step=10)
    other = source(tmp_path / "other", step=20)  # the same network, saved later
    shutil.rmtree(src / "rank_1")
    shutil.copytree(other / "rank_1", src / "rank_1")
    _refused(api, src, tmp_path / "out" / "dst", "shardwise.step", "'20'", "'10'", "different")


def test_rank_files_of_two_cuts_mixed_are_refused(tmp_path: Path) -> None:
    src = source(tmp_path / "s")
    whole = tmp_path / "s" / "whole.safetensors"
    other = sw.checkpoint.transform(whole, tmp_path / "other", split(4, {"q": (12, 4)}, dim=1))
    shutil.rmtree(src / "rank_2")
    shutil.copytree(other / "rank_2", src / "rank_2")
    _refused("transform", src, tmp_path / "out" / "dst", "another cut", "different checkpoints")


def test_a_strategy_that_does_not_divide_names_parameter_dim_and_axis(tmp_path: Path) -> None:
    src = source(tmp_path / "s")
    dst = tmp_path / "out" / "dst"
    bad = split(4, {"b": (6,)})  # 6 elements over 4 ranks
    with pytest.raises(CheckpointError) as info:
        sw.checkpoint.transform(src, dst, bad)
    for word in ("parameter 'b' [6]", "dim 0", "4 parts", "axes mp", "divides 6"):
        assert word in str(info.value), (word, str(info.value))
    assert not dst.exists() and hidden(dst.parent) == []

    strategy_file = tmp_path / "bad.json"  # the same through MindSpore's strategy file
    strategy_file.write_text(json.dumps(split(4, {"q": (12, 4)}, dim=1).to_json()))
    sw.transform_checkpoints(src, tmp_path / "fine", "ck_", None, strategy_file)  # 4 | 4
    strategy_file.write_text(json.dumps(split(8, {"q": (12, 4)}, dim=1).to_json()))
    with pytest.raises(CheckpointError, match=r"parameter 'q' \[12, 4\]: dim 1 .* 8 parts"):
        sw.transform_checkpoints(src, dst, "ck_", None, strategy_file)
    assert not dst.exists() and hidden(dst.parent) == []

    m = DeviceMatrix((4,), ("dp",))  # optimizer-parallel shards that do not divide: the fix
    whole_b = {"b": ParamPlan(TensorLayout(m, ((),)), (6,))}
    with pytest.raises(CheckpointError) as info:
        sw.checkpoint.transform(
            src, dst, CheckpointStrategy(4, m, whole_b, {"b": ShardSpec(("dp",), 4)})
        )
    for word in (
        "parameter 'b' [6]",
        "dim 0",
        "4 optimizer-parallel shards",
        "axes dp",
        "pad=True",
    ):
        assert word in str(info.value), (word, str(info.value))
    assert not dst.exists() and hidden(dst.parent) == []
    padded = CheckpointStrategy(4, m, whole_b, {"b": ShardSpec(("dp",), 4, pad=True)})
    sw.checkpoint.transform(src, dst, padded)  # (the fix)


def test_a_strategy_of_other_shapes_or_another_network_is_named(tmp_path: Path) -> None:
    src = source(tmp_path / "s")
    dst = tmp_path / "out" / "dst"
    with pytest.raises(CheckpointError, match=r"'q' is \[12, 4\] in the checkpoint but \[12, 8\]"):
        sw.checkpoint.transform(src, dst, split(2, {"q": (12, 8)}))
    with pytest.raises(CheckpointError, match=r"parameter 'fc.weight', the checkpoint does not"):
        sw.checkpoint.transform(src, dst, split(2, {"fc.weight": (4, 4)}))
    assert not dst.exists() and hidden(dst.parent) == []


def test_a_checkpoint_of_another_network_names_the_first_difference(tmp_path: Path) -> None:
    src = source(tmp_path / "s")
    net = Net({"w": (8, 6), "b": (6,), "q": (12, 5), "z": (3,)})  # q differs first, then z
    with pytest.raises(CheckpointError, match=r"'q' is \[12, 4\] in the checkpoint but \[12, 5\]"):
        sw.checkpoint.load_distributed(net, src)
    assert net.unchanged()
    net = Net({"w": (8, 6), "b": (6,), "q": (12, 4), "z": (3,)})
    with pytest.raises(CheckpointError, match=r"Net.z \[3\] is not in the checkpoint"):
        sw.checkpoint.load_distributed(net, src)
    assert net.unchanged()
    net = Net({"w": (8, 6), "b": (6,)})
    with pytest.raises(CheckpointError, match=r"checkpoint entry 'q' is not in Net"):
        sw.checkpoint.load_distributed(net, src)
    assert net.unchanged()


def test_strict_load_distributed_takes_names_under_the_wrapper_either_way(tmp_path: Path) -> None:
    """A checkpoint saved through an `AutoParallel` wrapper (``network.`` names) loads into the
    bare network with ``strict=True``, optimizer included, and a bare one into the wrapper; a
    dtype difference names load_distributed's own ``strict`` argument."""
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    opt = torch.optim.Adam(saved.parameters())
    saved(torch.randn(3, 4)).sum().backward()
    opt.step()
    wrapped = sw.AutoParallel(saved, parallel_mode="semi_auto")
    sw.save_checkpoint(wrapped, tmp_path / "wrap" / "c.safetensors", optimizer=opt)
    sw.save_checkpoint(saved, tmp_path / "bare" / "c.safetensors", optimizer=opt)
    for src, wrap in (("wrap", False), ("bare", True)):
        net = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        fresh = torch.optim.Adam(net.parameters())
        target = sw.AutoParallel(net, parallel_mode="semi_auto") if wrap else net
        assert sw.checkpoint.load_distributed(target, tmp_path / src, fresh) == ([], [])
        for (name, p), q in zip(net.named_parameters(), saved.parameters(), strict=True):
            assert torch.equal(p, q), (src, name)
            assert torch.equal(fresh.state[p]["exp_avg"], opt.state[q]["exp_avg"]), (src, name)
    double = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)).double()
    with pytest.raises(CheckpointError, match=r"\(strict=True does not convert; strict=False"):
        sw.checkpoint.load_distributed(double, tmp_path / "bare")


def _saved_with_adamw(path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.tensor([1, 2])).sum().backward()
    opt.step()
    sw.save_checkpoint(net, path / "ck.safetensors", optimizer=opt)


def test_a_refused_optimizer_state_leaves_network_and_optimizer_untouched(
    tmp_path: Path,
) -> None:
    """Optimizer state whose parameter groups differ (a parameter frozen now, trainable when
    saved) is refused before anything is copied, naming the parameter and the fix (the
    network's weights were overwritten, then the optimizer refused with both group lists)."""
    _saved_with_adamw(tmp_path)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
    net[0].weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(CheckpointError) as refused:
        sw.checkpoint.load_distributed(net, tmp_path, opt)
    message = str(refused.value)
    assert "group 0 matches no saved group: '0.weight' is in a saved parameter group" in message
    assert "but in no group of this optimizer (frozen here?)" in message
    assert "set the same requires_grad / parameter groups as the saving job" in message
    assert "'1.weight'" not in message  # (the parameters that match are not listed)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert not opt.state


def test_a_strict_dtype_refusal_leaves_the_network_untouched(tmp_path: Path) -> None:
    """With ``strict=True`` a dtype difference on any entry is refused before the first copy
    (the entries before it in the network were already overwritten)."""
    _saved_with_adamw(tmp_path)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
    net[1].double()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"cannot load '1.weight'.*strict=True does not"):
        sw.checkpoint.load_distributed(net, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_a_shape_refusal_with_strict_false_leaves_the_network_untouched(tmp_path: Path) -> None:
    """``strict=False`` leaves out missing and extra entries, but one of another shape is
    refused: before any copy (the entries before it were overwritten)."""
    _saved_with_adamw(tmp_path)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 5))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"cannot load '1.(weight|bias)'.*nothing was loaded"):
        sw.checkpoint.load_distributed(net, tmp_path, strict=False)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_optimizer_groups_that_differ_name_the_parameters_in_a_short_message(
    tmp_path: Path,
) -> None:
    """`load_optimizer_state` into an optimizer whose groups differ names the parameters
    that differ, each kind of difference, with long lists cut (it printed both group lists in
    full: thousands of characters on GPT-2)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(40)])
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sw.save_checkpoint(net, tmp_path / "ck.safetensors", optimizer=opt)
    ckpt = sw.load_checkpoint(tmp_path / "ck.safetensors")
    params = list(net.named_parameters())
    frozen = torch.optim.SGD([p for n, p in params if not n.startswith("0.")], lr=0.1)
    with pytest.raises(CheckpointError) as refused:
        sw.checkpoint.load_optimizer_state(frozen, ckpt, net)
    assert "'0.weight', '0.bias' are in a saved parameter group but in no group" in str(
        refused.value
    )
    assert len(str(refused.value)) < 400
    split_groups = torch.optim.SGD(
        [{"params": [p for _, p in params[:40]]}, {"params": [p for _, p in params[40:]]}],
        lr=0.1,
    )
    with pytest.raises(CheckpointError) as refused:
        sw.checkpoint.load_optimizer_state(split_groups, ckpt, net)
    message = str(refused.value)
    assert "'0.weight' is in saved group 0 with 80 parameters" in message
    assert "this optimizer's group 0 with 40" in message
    assert "and 76 more" in message and len(message) < 500


def _writers(src: Path, dst: Path, overwrite: bool) -> dict[str, Callable[[], object]]:
    return {
        "transform": lambda: sw.checkpoint.transform(src, dst, 2, overwrite=overwrite),
        "merge": lambda: sw.checkpoint.merge(src, dst / "m.safetensors", overwrite=overwrite),
        "transform_checkpoints": lambda: sw.transform_checkpoints(
            src, dst, "ck_", overwrite=overwrite
        ),
        "unified_safetensors": lambda: sw.checkpoint.unified_safetensors(
            src, None, dst, overwrite=overwrite
        ),
    }


@pytest.mark.parametrize(
    "api", ["transform", "merge", "transform_checkpoints", "unified_safetensors"]
)
def test_an_existing_destination_is_refused_and_kept(api: str, tmp_path: Path) -> None:
    src = source(tmp_path / "s")
    dst = tmp_path / "out" / "dst"
    target = dst / "m.safetensors" if api == "merge" else dst
    target.parent.mkdir(parents=True)
    if api == "merge":
        target.write_bytes(b"an older merged file")
    else:
        (dst / "rank_0").mkdir(parents=True)
        (dst / "rank_0" / "old.safetensors").write_bytes(b"an older checkpoint")
    before = snapshot(target)
    with pytest.raises(CheckpointError) as info:
        _writers(src, dst, overwrite=False)[api]()
    assert f"{target} exists" in str(info.value) and "overwrite=True" in str(info.value)
    assert snapshot(target) == before and hidden(target.parent) == []


@pytest.mark.parametrize(
    "api", ["transform", "merge", "transform_checkpoints", "unified_safetensors"]
)
def test_overwrite_replaces_only_with_a_complete_checkpoint(api: str, tmp_path: Path) -> None:
    src = source(tmp_path / "s")
    dst = tmp_path / "out" / "dst"
    _writers(source(tmp_path / "older", seed=1), dst, overwrite=False)[api]()
    target = dst / "m.safetensors" if api == "merge" else dst
    before = snapshot(target)

    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    _corrupt(broken / "rank_3" / "whole.safetensors", "w")  # fails after some files are written
    with pytest.raises(CheckpointError, match="corrupt"):
        _writers(broken, dst, overwrite=True)[api]()
    assert snapshot(target) == before and hidden(target.parent) == []

    _writers(src, dst, overwrite=True)[api]()
    assert snapshot(target) != before and hidden(target.parent) == []
    got = merged(dst, tmp_path / "check.safetensors") if api != "merge" else None
    got = got or dict(sw.load_checkpoint(target))
    assert got.keys() == SHAPES.keys()
    assert all(torch.equal(got[k], v) for k, v in tensors().items())


def test_a_strategy_whose_device_num_is_not_its_matrix_is_refused() -> None:
    """device_num 3 on a 2 x 2 matrix was accepted: `transform` wrote ranks 0-2 only, the
    fourth block of every split parameter lost, found only at merge or load."""
    m = DeviceMatrix((2, 2), ("dp", "mp"))
    params = {"weight": ParamPlan(TensorLayout(m, ((0,), (1,))), (8, 6))}
    assert CheckpointStrategy(4, m, params).device_num == 4
    for n in (3, 2, 8):
        with pytest.raises(ValueError, match=rf"device_num {n} is not the size of its device"):
            CheckpointStrategy(n, m, params)


def test_a_rank_file_into_a_whole_network_names_its_piece_readably(tmp_path: Path) -> None:
    """The piece was printed as raw JSON lists (``[[[4, 8]], [[0, 4]]] of a [8, 4] tensor``)."""
    net = torch.nn.Linear(4, 8)
    sw.save_checkpoint(net, tmp_path / "one" / "net.safetensors")
    m = DeviceMatrix((2,), ("mp",))
    rows = CheckpointStrategy(2, m, {"weight": ParamPlan(TensorLayout(m, ((0,), ())), (8, 4))})
    sw.checkpoint.transform(tmp_path / "one", tmp_path / "two", rows)
    part = sw.load_checkpoint(tmp_path / "two" / "rank_1" / "net.safetensors")
    with pytest.raises(CheckpointError, match=r"it holds \[4:8, 0:4\] of \[8, 4\]\): load the"):
        sw.load_param_into_net(torch.nn.Linear(4, 8), part)


def test_undescribed_rank_files_of_a_tied_weight_merge_by_the_strategy_file(
    tmp_path: Path,
) -> None:
    """Rank files saved from state_dict blocks (no recorded cut) of an hsdp job with a tied
    weight merge by the job's parameter strategy file, which records the tie; a file without
    it is refused naming the parameter the file lacks, not asking for src_strategy again."""
    torch.manual_seed(0)
    net = TiedHead()
    full = net.emb.weight.detach().clone()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="semi_auto").hsdp(threshold=0)
        parallel.plan(shapes=[(4, 3)], dtypes=[torch.int64])
        parallel.save_param_strategy_file(tmp_path / "params.json")
        state = net.state_dict()
        for r in range(2):
            blocks = {k: comm.rank_parts(v)[r].clone() for k, v in state.items()}
            sw.save_checkpoint(blocks, tmp_path / "c" / f"rank_{r}" / "x.safetensors")
    data = json.loads((tmp_path / "params.json").read_text())
    assert data["aliases"] == {"head.weight": "emb.weight"}
    out = sw.checkpoint.merge(
        tmp_path / "c", tmp_path / "m.safetensors", src_strategy=tmp_path / "params.json"
    )
    got = safetensors.torch.load_file(out)
    assert torch.equal(got["emb.weight"], full) and torch.equal(got["head.weight"], full)
    del data["aliases"]  # (a file written before ties were recorded)
    (tmp_path / "old.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as info:
        old = tmp_path / "old.json"
        sw.checkpoint.merge(tmp_path / "c", tmp_path / "n.safetensors", src_strategy=old)
    message = str(info.value)
    assert "no parameter 'head.weight'" in message and "aliases" in message
    assert "need src_strategy" not in message


class _Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.frozen(x)))
        return out


def test_a_strategy_file_leaving_out_a_cut_frozen_parameter_warns(tmp_path: Path) -> None:
    """A strategy file saved through the context (``only_trainable_params`` True by default)
    leaves out a frozen parameter the plan cuts: transform and transform_checkpoints to it
    warn, naming it and the cause (each rank's file holds it whole, as MindSpore keeps a
    parameter its destination strategy lacks); a file of every parameter does not warn."""
    torch.manual_seed(0)
    sw.save_checkpoint(_Frozen(), tmp_path / "one" / "c.safetensors")
    try:
        sw.set_auto_parallel_context(strategy_ckpt_config={"save_file": str(tmp_path / "t.json")})
        net = _Frozen()
        with simulated_world(4) as world:
            world.replicate(net)
            sw.shard(net.frozen, in_strategy=((1, 1), (4, 1)))
            parallel = sw.AutoParallel(net, parallel_mode="semi_auto")
            parallel.plan(shapes=[(8, 8)], dtypes=[torch.float32])
            parallel.save_param_strategy_file(tmp_path / "all.json")
    finally:
        sw.reset_auto_parallel_context()
    assert json.loads((tmp_path / "t.json").read_text())["left_out"] == [
        "frozen.bias",
        "frozen.weight",
    ]
    cause = r"\['frozen.bias', 'frozen.weight'\] are not in .*only_trainable_params=True"
    with pytest.warns(UserWarning, match=cause):
        sw.checkpoint.transform(tmp_path / "one", tmp_path / "a", tmp_path / "t.json")
    with pytest.warns(UserWarning, match=cause):
        sw.transform_checkpoints(tmp_path / "one", tmp_path / "b", "ck_", None, tmp_path / "t.json")
    whole_rank_1 = safetensors.torch.load_file(tmp_path / "a" / "rank_1" / "c.safetensors")
    assert whole_rank_1["frozen.weight"].shape == (16, 8)  # (kept whole, as warned)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sw.checkpoint.transform(tmp_path / "one", tmp_path / "c", tmp_path / "all.json")
    cut_rank_1 = safetensors.torch.load_file(tmp_path / "c" / "rank_1" / "c.safetensors")
    assert cut_rank_1["frozen.weight"].shape == (4, 8)
