"""Small distributed checkpoints for the transform tests: cut strategies, a saved source, a
byte snapshot of a destination, the hidden files left next to it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

import shardwise as sw
from shardwise.checkpoint import CheckpointStrategy
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner import ParamPlan

SHAPES = {"w": (8, 6), "b": (6,), "q": (12, 4)}


def tensors(
    seed: int = 0, shapes: Mapping[str, tuple[int, ...]] = SHAPES
) -> dict[str, torch.Tensor]:
    """Random tensors of `shapes` (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def split(n: int, shapes: Mapping[str, tuple[int, ...]], dim: int = 0) -> CheckpointStrategy:
    """`n` ranks, each parameter of `shapes` split along `dim` over them."""
    m = DeviceMatrix((n,), ("mp",))
    params = {}
    for name, shape in shapes.items():
        dims = tuple((0,) if d == dim else () for d in range(len(shape)))
        params[name] = ParamPlan(TensorLayout(m, dims), shape)
    return CheckpointStrategy(n, m, params)


FOUR = {"w": (8, 6), "q": (12, 4)}  # (b stays whole: 6 does not divide by 4)


def source(root: Path, ranks: int = 4, seed: int = 0, step: int | None = None) -> Path:
    """`tensors(seed)` saved as a `ranks`-rank checkpoint ``root/ckpt`` (w and q split along
    dim 0), built from a one-device file."""
    root.mkdir(parents=True, exist_ok=True)
    whole = sw.save_checkpoint(tensors(seed), root / "whole.safetensors", step=step)
    return sw.checkpoint.transform(whole, root / "ckpt", split(ranks, FOUR))


def snapshot(path: Path) -> dict[str, bytes] | None:
    """Every file's bytes under `path` (a file: ``{"": bytes}``); None when absent."""
    if path.is_file():
        return {"": path.read_bytes()}
    if not path.exists():
        return None
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def hidden(folder: Path) -> list[str]:
    """The hidden entries of `folder` (a transform's partial or old outputs)."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


class Net(nn.Module):
    """The network whose weights `tensors` holds (`shapes` to make another network)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]] = SHAPES) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.full(shape, 7.0)))

    def unchanged(self) -> bool:
        """Whether no parameter was written since construction."""
        return all(bool((p == 7.0).all()) for p in self.parameters())


def merged(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """The whole tensors of checkpoint `src` (merged into `out`)."""
    sw.checkpoint.merge(src, out, optimizer=True)
    return dict(sw.load_checkpoint(out))
