"""Re-cutting checkpoints between plans and device counts, at the tensor level, on real plans.

A single-device checkpoint of a trained MLP (weights and Adam state) is cut for real plans
(made by `AutoParallel.plan` on simulated ranks): 8 -> 4 -> 2 -> 1 ranks, tensor parallel ->
data parallel with hsdp level 3, a Layout with tuple axes -> int strategies, padded hsdp shards
-> unpadded, strided blocks. Every rank file must hold exactly the block the plan gives that
rank, computed here from `TensorLayout.local_index` and the optimizer-parallel shard groups
(independently of the checkpoint code), and the way back to one device must give the original
tensors bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from tests.zoo import TiedHead
from torch import nn

import shardwise as sw
from shardwise.checkpoint import CheckpointStrategy, ShardSpec, merge, transform
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.optim._groups import group_ranks
from shardwise.parallel import AutoParallel
from shardwise.planner import ParallelPlan, ParamPlan
from shardwise.testing import simulated_world

BATCH = [(16, 32), (16,)]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out


def tensor_parallel(net: MLP) -> None:
    sw.shard(net.fc1, in_strategy=((2, 1), (4, 1)))  # column parallel over mp = 4
    sw.shard(net.fc2, in_strategy=((2, 4), (1, 4)))  # row parallel


def tuple_axes(net: MLP) -> None:
    layout = sw.Layout((2, 4), ("dp", "mp"))
    sw.shard(net.fc1, in_strategy=(layout("None", "None"), layout(("dp", "mp"), "None")))


def planned(
    annotate: object = None, level: str | None = None, lr: float = 1e-3
) -> tuple[MLP, torch.optim.Optimizer, AutoParallel, ParallelPlan]:
    """The MLP, its Adam, its `AutoParallel` train step and the plan it makes (in the job or
    world the caller runs)."""
    net = MLP()
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    if callable(annotate):
        annotate(net)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss

    parallel = AutoParallel(step, parallel_mode="semi_auto")
    if level is not None:
        parallel.hsdp(threshold=0, optimizer_level=level)
    return net, opt, parallel, parallel.plan(shapes=BATCH, dtypes=[torch.float32, torch.int64])


def plan_of(n: int, annotate: object = None, level: str | None = None) -> ParallelPlan:
    """The plan an `AutoParallel` train step of the MLP makes on `n` ranks."""
    with simulated_world(n):
        return planned(annotate, level)[3]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A one-device checkpoint of the MLP after 2 Adam steps, and its tensors."""
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for _ in range(2):
        nn.functional.cross_entropy(net(torch.randn(16, 32)), torch.randint(0, 8, (16,))).backward()
        opt.step()
    path = tmp_path_factory.mktemp("single") / "ckpt-1_2.safetensors"
    sw.save_checkpoint(net, path, step=2, optimizer=opt)
    return path, safetensors.torch.load_file(path)


def expected_block(plan: ParallelPlan, key: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s block of entry `key` under `plan`, from the layout and hsdp groups."""
    owner = key.removeprefix("optimizer.state.").rpartition(".")[0] if "state." in key else key
    p = plan.params.get(owner)
    if p is None or tuple(full.shape) != tuple(p.shape):
        return full
    block = full[p.layout.local_index(rank, p.shape)]
    for b in plan.buckets:
        if b.kind == "shard" and owner in b.params and b.shard > 1:
            axes = [plan.matrix.names.index(a) for a in b.axes]
            group = group_ranks(plan.matrix, axes, b.shard, rank)[0]
            rows = block.shape[0] // b.shard
            block = block[group.index(rank) * rows : (group.index(rank) + 1) * rows]
    return block


def check_cut(out: Path, plan: ParallelPlan, full: dict[str, torch.Tensor]) -> None:
    for rank in range(plan.device_num):
        (path,) = (out / f"rank_{rank}").glob("*.safetensors")
        got = safetensors.torch.load_file(path)
        assert set(got) == set(full)
        for key, value in full.items():
            assert torch.equal(got[key], expected_block(plan, key, value, rank)), (rank, key)


def test_eight_four_two_one(trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    src, full = trained
    plans = {8: plan_of(8, tensor_parallel, "level1"), 4: plan_of(4, None, "level3"),
             2: plan_of(2)}  # fmt: skip
    assert {b.kind for b in plans[8].buckets} == {"shard"}
    previous = src
    for n in (8, 4, 2):
        transform(previous, tmp_path / f"r{n}", plans[n])
        check_cut(tmp_path / f"r{n}", plans[n], full)
        previous = tmp_path / f"r{n}"
    transform(previous, tmp_path / "r1")
    back = safetensors.torch.load_file(tmp_path / "r1" / "ckpt-1_2.safetensors")
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
    ckpt = sw.load_checkpoint(tmp_path / "r1" / "ckpt-1_2.safetensors")  # metadata carried
    assert ckpt.step == 2 and ckpt.optimizer_state is not None


def test_tensor_parallel_to_data_parallel_hsdp3(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    src, full = trained
    tp, dp3 = plan_of(8, tensor_parallel), plan_of(8, None, "level3")
    transform(src, tmp_path / "tp", tp)
    transform(tmp_path / "tp", tmp_path / "dp3", dp3)
    check_cut(tmp_path / "dp3", dp3, full)
    shard = safetensors.torch.load_file(tmp_path / "dp3" / "rank_5" / "ckpt-1_2.safetensors")
    assert shard["fc1.weight"].shape == (8, 32)  # 64 rows over 8 ranks


def test_tuple_axes_layout_to_int_strategies(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    src, full = trained
    tup, ints = plan_of(8, tuple_axes), plan_of(8, tensor_parallel)
    assert len(tup.params["fc1.weight"].layout.dims[0]) == 2  # (dp, mp) on one dim
    transform(src, tmp_path / "tup", tup)
    check_cut(tmp_path / "tup", tup, full)
    transform(tmp_path / "tup", tmp_path / "ints", ints)
    check_cut(tmp_path / "ints", ints, full)


def test_padded_shards_to_unpadded(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    full = {"w": torch.randn(10, 3, generator=g), "b": torch.randn(10, generator=g)}
    sw.save_checkpoint(full, tmp_path / "one.safetensors")
    m = DeviceMatrix((4,), ("dp",))
    plain = TensorLayout(m, ((),))
    padded = CheckpointStrategy(
        4, m, {"w": ParamPlan(TensorLayout(m, ((), ())), (10, 3)), "b": ParamPlan(plain, (10,))},
        {"w": ShardSpec(("dp",), 4, pad=True), "b": ShardSpec(("dp",), 4, pad=True)},
    )  # fmt: skip
    transform(tmp_path / "one.safetensors", tmp_path / "padded", padded)
    last = safetensors.torch.load_file(tmp_path / "padded" / "rank_3" / "one.safetensors")
    assert last["w"].shape == (3, 3)  # ceil(10 / 4) rows: 1 real, 2 padding (zeros)
    assert torch.equal(last["w"][0], full["w"][9]) and not last["w"][1:].any()
    transform(tmp_path / "padded", tmp_path / "two", 2)  # 2 replicas, unpadded
    for r in range(2):
        two = safetensors.torch.load_file(tmp_path / "two" / f"rank_{r}" / "one.safetensors")
        assert all(torch.equal(two[k], full[k]) for k in full)


def test_strided_blocks(tmp_path: Path) -> None:
    """A fused qkv weight stored with `sw.strided` (each rank: its rows of q, of k and of v)."""
    full = {"qkv": torch.arange(12 * 4, dtype=torch.float32).reshape(12, 4)}
    sw.save_checkpoint(full, tmp_path / "one.safetensors")
    m = DeviceMatrix((2,), ("mp",))
    strided = CheckpointStrategy(
        2, m, {"qkv": ParamPlan(TensorLayout(m, ((0,), ()), (3, 1)), (12, 4))}
    )
    transform(tmp_path / "one.safetensors", tmp_path / "s", strided)
    r1 = safetensors.torch.load_file(tmp_path / "s" / "rank_1" / "one.safetensors")["qkv"]
    assert r1[:, 0].tolist() == [8.0, 12.0, 24.0, 28.0, 40.0, 44.0]  # rows 2-3, 6-7, 10-11
    merge(tmp_path / "s", tmp_path / "m.safetensors")
    assert torch.equal(safetensors.torch.load_file(tmp_path / "m.safetensors")["qkv"], full["qkv"])


def test_merge_loads_into_plain_torch(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    src, full = trained
    transform(src, tmp_path / "tp", plan_of(8, tensor_parallel, "level1"))
    out = merge(tmp_path / "tp", tmp_path / "model.safetensors")
    code = (
        "import sys, torch, safetensors.torch\n"
        "net = torch.nn.Sequential()\n"
        "net.fc1 = torch.nn.Linear(32, 64); net.fc2 = torch.nn.Linear(64, 8)\n"
        f"net.load_state_dict(safetensors.torch.load_file({str(out)!r}))\n"
        "assert 'shardwise' not in sys.modules\n"
        "print(repr(float(sum(p.double().sum() for p in net.parameters()))))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    want = sum(full[k].double().sum() for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    assert float(run.stdout) == float(want)


def test_load_distributed_before_and_after_planning(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    src, full = trained
    transform(src, tmp_path / "tp", plan_of(8, tensor_parallel, "level1"))
    net = MLP()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    assert sw.checkpoint.load_distributed(net, tmp_path / "tp", opt) == ([], [])
    for name, p in net.named_parameters():
        assert torch.equal(p.detach(), full[name])
        assert torch.equal(opt.state[p]["exp_avg"], full[f"optimizer.state.{name}.exp_avg"])
    with simulated_world(4):  # a planned network receives each rank's block
        net = MLP()
        parallel = AutoParallel(net, parallel_mode="semi_auto").hsdp(threshold=0)
        plan = parallel.plan(shapes=[(16, 32)])
        transform(tmp_path / "tp", tmp_path / "own", plan)  # (file work runs in a world too)
        sw.checkpoint.load_distributed(net, tmp_path / "own")
        for name, p in net.named_parameters():
            parts = sw.communication.rank_parts(p.detach())
            for rank, part in enumerate(parts):
                assert torch.equal(part, expected_block(plan, name, full[name], rank)), name


def test_mindspore_names(trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    src, full = trained
    plan = plan_of(4, None, "level3")
    sw.planner.save_param_strategy_file(plan, tmp_path / "dst.json")
    transform(src, tmp_path / "a", 2)
    with simulated_world(4):  # (file work: in a world as outside it)
        sw.transform_checkpoints(
            tmp_path / "a", tmp_path / "b", "ckpt_", None, tmp_path / "dst.json"
        )
        out = sw.parallel.unified_safetensors(tmp_path / "b", tmp_path / "dst.json", tmp_path / "u")
    assert sorted(p.name for p in (tmp_path / "b").rglob("*.safetensors")) == [
        f"ckpt_{r}.safetensors" for r in range(4)
    ]
    check_cut(tmp_path / "b", plan, full)
    assert all(torch.equal(v, full[k]) for k, v in safetensors.torch.load_file(out).items())


def test_a_rank_file_into_a_whole_network_names_the_fix(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    src, _ = trained
    transform(src, tmp_path / "tp", plan_of(8, tensor_parallel))
    ckpt = sw.load_checkpoint(tmp_path / "tp" / "rank_1" / "ckpt-1_2.safetensors")
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"load_distributed\(net, '.*tp'\)"):
        sw.load_param_into_net(MLP(), ckpt)


def test_another_ranks_file_is_refused_by_the_plain_functions(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """After planning, a rank file loads with load_param_into_net / load_optimizer_state on
    the rank whose blocks it holds; another rank's file (a path without the rank) is refused
    instead of training on the wrong block."""
    src, full = trained
    transform(src, tmp_path / "tp", plan_of(8, tensor_parallel))
    file = {r: tmp_path / "tp" / f"rank_{r}" / "ckpt-1_2.safetensors" for r in (1, 2, 5)}
    with sw.communication.dry_run(8, rank=1):
        net, opt, _parallel, plan = planned(tensor_parallel, lr=0.01)  # (the wrapper kept)
        for r in (1, 5):  # (rank 5 holds rank 1's blocks: dp 2 x mp 4, no optimizer parallel)
            ckpt = sw.load_checkpoint(file[r])
            assert sw.load_param_into_net(net, ckpt) == ([], [])
            sw.checkpoint.load_optimizer_state(opt, ckpt, net)
        block = expected_block(plan, "fc1.weight", full["fc1.weight"], 1)
        assert torch.equal(net.fc1.weight.detach(), block)
        wrong = sw.load_checkpoint(file[2])
        fix = r"'fc1\.weight' holds \[32:48, 0:32\].*rank 2 of 8.*holds \[16:32, 0:32\].*own file"
        with pytest.raises(sw.checkpoint.CheckpointError, match=fix):
            sw.load_param_into_net(net, wrong)
        with pytest.raises(sw.checkpoint.CheckpointError, match="rank 1's own file"):
            sw.checkpoint.load_optimizer_state(opt, wrong, net)
        assert torch.equal(net.fc1.weight.detach(), block)  # (nothing loaded)


def test_undescribed_rank_files_of_a_cut_tensor_are_refused(tmp_path: Path) -> None:
    """Blocks saved as plain dicts (no recorded cut) look whole; their values differ, so the
    checkpoint is refused instead of merged as rank 0's block."""
    full = torch.arange(16.0).reshape(4, 4)
    for r in range(2):
        sw.save_checkpoint(
            {"w": full[2 * r : 2 * r + 2]}, tmp_path / "c" / f"rank_{r}" / "x.safetensors"
        )
    with pytest.raises(sw.checkpoint.CheckpointError, match="need src_strategy"):
        merge(tmp_path / "c", tmp_path / "m.safetensors")
    m = DeviceMatrix((2,), ("dp",))
    rows = CheckpointStrategy(2, m, {"w": ParamPlan(TensorLayout(m, ((0,), ())), (4, 4))})
    merge(tmp_path / "c", tmp_path / "m.safetensors", src_strategy=rows)  # with it: whole again
    assert torch.equal(safetensors.torch.load_file(tmp_path / "m.safetensors")["w"], full)


def test_a_module_named_optimizer_is_a_model_entry(tmp_path: Path) -> None:
    net = nn.Module()
    net.optimizer = nn.Linear(2, 3)
    opt = torch.optim.Adam(net.parameters())
    net.optimizer(torch.ones(1, 2)).sum().backward()
    opt.step()
    sw.save_checkpoint(net, tmp_path / "c" / "x.safetensors", optimizer=opt)
    merge(tmp_path / "c", tmp_path / "m.safetensors")
    assert sorted(safetensors.torch.load_file(tmp_path / "m.safetensors")) == [
        "optimizer.bias",
        "optimizer.weight",
    ]
    fresh = nn.Module()
    fresh.optimizer = nn.Linear(2, 3)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    assert sw.checkpoint.load_distributed(fresh, tmp_path / "c", fresh_opt) == ([], [])
    assert torch.equal(fresh.optimizer.weight, net.optimizer.weight)
    assert torch.equal(
        fresh_opt.state[fresh.optimizer.weight]["exp_avg"],
        opt.state[net.optimizer.weight]["exp_avg"],
    )


def test_a_destination_may_not_hold_its_source(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """Nor may merge's file go into a rank folder (it would be read as another file of that
    rank); beside the rank folders it may."""
    src, full = trained
    transform(src, tmp_path / "p", 2)
    (tmp_path / "p" / "precious.txt").write_text("keep")
    with pytest.raises(sw.checkpoint.CheckpointError, match="holds the checkpoint it is made from"):
        transform(tmp_path / "p", tmp_path / "p", 1, overwrite=True)
    with pytest.raises(sw.checkpoint.CheckpointError, match="holds the checkpoint it is made from"):
        merge(tmp_path / "p", tmp_path, overwrite=True)
    inside = tmp_path / "p" / "rank_0" / "merged.safetensors"
    beside = tmp_path / "p" / "merged.safetensors"
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"merge: .* write it outside, e\.g\."):
        merge(tmp_path / "p", inside)
    assert not inside.exists()
    assert (tmp_path / "p" / "precious.txt").read_text() == "keep"
    assert len(list((tmp_path / "p").rglob("*.safetensors"))) == 2
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"merge: .* write it outside, e\.g\."):
        merge(tmp_path / "p", tmp_path / "p" / "rank_7" / "merged.safetensors")  # (a new rank)
    merge(tmp_path / "p", beside)
    merge(tmp_path / "p", tmp_path / "p" / "merged" / "m.safetensors")  # (no rank folder: unread)
    net = MLP()
    assert sw.checkpoint.load_distributed(net, tmp_path / "p") == ([], [])
    assert torch.equal(net.fc1.weight, full["fc1.weight"])


def test_tied_weights_follow_their_parameter(tmp_path: Path) -> None:
    """A strategy made from a plan lists the tied weight once; the transform cuts the tied
    name as the job itself stored it (the checkpoint records the alias)."""

    with simulated_world(2):
        net = TiedHead()
        parallel = AutoParallel(net, parallel_mode="semi_auto").hsdp(threshold=0)
        plan = parallel.plan(shapes=[(4, 3)], dtypes=[torch.int64])
    assert "head.weight" not in plan.params  # (one entry for the tied pair)
    single = TiedHead()
    sw.save_checkpoint(single, tmp_path / "one" / "x.safetensors")
    strategy = CheckpointStrategy.from_plan(plan, {"head.weight": "emb.weight"})
    transform(tmp_path / "one", tmp_path / "a", strategy)  # records the alias
    transform(tmp_path / "a", tmp_path / "b", plan)  # the plan alone: the alias still cut
    got = safetensors.torch.load_file(tmp_path / "b" / "rank_1" / "x.safetensors")
    assert got["head.weight"].shape == got["emb.weight"].shape == (8, 8)
    assert torch.equal(got["head.weight"], single.emb.weight.detach()[8:])


def test_names_under_a_wrapper(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """A checkpoint saved through an `AutoParallel` wrapper (``network.`` names, recorded as the
    strategy's prefix) is re-cut by the network's own plan, and merges to the network's names."""
    _, full = trained
    wrapped = {f"network.{k}": v for k, v in full.items() if not k.startswith("optimizer.")}
    sw.save_checkpoint(wrapped, tmp_path / "one" / "x.safetensors")
    plan = plan_of(4, None, "level3")
    transform(
        tmp_path / "one", tmp_path / "a", CheckpointStrategy.from_plan(plan).renamed("network.")
    )
    transform(tmp_path / "a", tmp_path / "b", plan)  # the plan's names carry no prefix
    rank2 = safetensors.torch.load_file(tmp_path / "b" / "rank_2" / "x.safetensors")
    assert torch.equal(
        rank2["network.fc1.weight"], expected_block(plan, "fc1.weight", full["fc1.weight"], 2)
    )
    out = merge(tmp_path / "b", tmp_path / "m.safetensors")
    plain = MLP()
    plain.load_state_dict(safetensors.torch.load_file(out))
    assert torch.equal(plain.fc2.weight.detach(), full["fc2.weight"])
