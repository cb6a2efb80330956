"""Worker for test_dcp.py: torch's own FSDP2 and DCP code on real gloo processes.

Run by `shardwise run` on 2 ranks with an output folder. Torch side only (no shardwise
checkpoint code), so the test checks shardwise against what torch itself saves and loads:

- save: an FSDP2 (``fully_shard``, ``Shard(0)``) model and Adam after one step, saved with
  ``dcp.save`` twice: ``{"model": ..., "optimizer": ...}`` (``torch_nested``) and torchtitan's
  layout, model at the top level and ``flatten_optimizer_state_dict=True`` (``torch_flat``);
  rank 0 writes the full values (``torch_full.safetensors``) and the loss after one more step.
- load (when the test left ``shardwise_dcp``, `export_dcp`'s output): ``dcp.load`` into a
  fresh FSDP2 model and Adam (``set_model_state_dict`` / ``set_optimizer_state_dict``) and into
  ``Shard(1)`` DTensors; every value must equal ``shardwise_full.safetensors`` exactly, and the
  next step's loss the one the test computed on one device.

Each rank prints ``CHECK <name> OK``; a mismatch raises.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardwise.communication import init, release

LR = 1e-2


def network(seed: int = 0) -> nn.Sequential:
    """The model both sides use: 10 and 3 rows (3 do not split evenly over 2 ranks)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x, y = batch()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def loss(model: nn.Module) -> float:
    x, y = batch()
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def full_values(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Model entries and ``optimizer.state.<fqn>.<key>``, whole (collective)."""
    options = StateDictOptions(full_state_dict=True)
    out = dict(get_model_state_dict(model, options=options))
    state = get_optimizer_state_dict(model, opt, options=options)["state"]
    for fqn, entries in state.items():
        out |= {f"optimizer.state.{fqn}.{k}": v for k, v in entries.items()}
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def fsdp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = network(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def save(out: Path) -> None:
    model, opt = fsdp(0)
    step(model, opt)
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out / "torch_nested")
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    titan = {**msd, "optimizer": get_optimizer_state_dict(model, opt, options=flat)}
    dcp.save(titan, checkpoint_id=out / "torch_flat")
    full = full_values(model, opt)
    step(model, opt)
    after = loss(model)
    if dist.get_rank() == 0:
        safetensors.torch.save_file(full, out / "torch_full.safetensors")
        (out / "torch_loss.json").write_text(json.dumps(after.hex()))
    print("CHECK save OK", flush=True)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for k, v in got.items():
        if not torch.equal(v, want[k]):
            raise AssertionError(f"{what}: {k} differs")


def load(out: Path) -> None:
    want = safetensors.torch.load_file(out / "shardwise_full.safetensors")
    model, opt = fsdp(5)
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=out / "shardwise_dcp")
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, opt, osd)
    got = full_values(model, opt)
    if set(got) != set(want):
        raise AssertionError(f"FSDP2 load: entries {sorted(set(got) ^ set(want))}")
    _same(got, want, "FSDP2 load")
    print("CHECK load_fsdp2 OK", flush=True)
    step(model, opt)
    expected = float.fromhex(json.loads((out / "shardwise_loss.json").read_text()))
    if loss(model) != expected:
        raise AssertionError(f"next loss {loss(model)!r} != {expected!r} on one device")
    print("CHECK continue OK", flush=True)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cols = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(v.dim() - 1)])
            for k, v in want.items() if not k.startswith("optimizer.")}  # fmt: skip
    dcp.load({"model": cols}, checkpoint_id=out / "shardwise_dcp")
    _same({k: v.full_tensor() for k, v in cols.items()}, want, "Shard(-1) load")
    print("CHECK load_dtensor OK", flush=True)


def main() -> None:
    out = Path(sys.argv[1])
    init()  # (torch's gloo group; release() ends it cleanly, see communication/_exit.py)
    torch.set_num_threads(1)
    save(out)
    if (out / "shardwise_dcp").exists():
        load(out)
    release()


if __name__ == "__main__":
    main()
