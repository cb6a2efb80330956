"""Data loading: ``sw.dataset.MnistDataset`` + the seed's transforms vs a plain torch DataLoader.

One single-rank job (`worker`) reads MNIST's training split one epoch at a time through:

- ``shardwise``: ``MnistDataset(dir, "train", num_parallel_workers=w)``, mapped with
  ``vision.Rescale(1/255, 0)``, ``vision.Normalize((0.1307,), (0.3081,))``, ``vision.HWC2CHW()``
  on ``image`` and ``transforms.TypeCast(torch.int64)`` on ``label``, then ``batch(32)``;
- ``torch per-sample``: what a PyTorch user writes (torchvision style, by hand since
  torchvision is not installed): a ``Dataset`` over the uint8 tensor whose ``__getitem__``
  does ToTensor + Normalize on one image, ``DataLoader(batch_size=32, shuffle=True,
  num_workers=w)``;
- ``torch batched``: the same transforms once per batch (a ``BatchSampler`` as sampler);
- ``shardwise sharded``: ``MnistDataset(..., num_shards=4, shard_id=0)`` with ``batch(8)``:
  what rank 0 of 4 reads.

for w = 0 and 2. `_check_values` first compares the first batch of both sides (no shuffle);
`_check_shards` checks that the 4 shards' batches put side by side are the unsharded batches
of 32. `harness.compare` times one epoch per call, alternating the order. Real MNIST comes
from ``data/MNIST`` (``make data``); without it (and always with ``--quick``) a random IDX set
is written with `shardwise.dataset.idx.write_idx` into a temporary folder, and the table
says so.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.harness import (
    REPO_ROOT,
    BenchConfig,
    Table,
    compare,
    fmt_ms,
    host_info,
    save_report,
    spawn,
)

if TYPE_CHECKING:
    import torch

MNIST_DIR = REPO_ROOT / "data" / "MNIST"
MNIST_ROWS = 60000
QUICK_ROWS = 1024
BATCH = 32
SHARDS, SHARD_BATCH = 4, 8
MEAN, STD = 0.1307, 0.3081
SEED = 1
WORKERS = (0, 2)
KINDS = (("images", 3), ("labels", 1))


@dataclass(frozen=True)
class LoadResult:
    """One pipeline at one worker count: an epoch's time and what it yielded."""

    pipeline: str
    workers: int
    batch: int
    rows: int  # rows yielded per epoch
    batches: int
    epoch_s: float  # median of the repetitions
    first_batch_s: float  # median time from iter() to the first batch
    reps: int

    @property
    def samples_per_s(self) -> float:
        return self.rows / self.epoch_s


# --------------------------------------------------------------------------- data


@contextmanager
def mnist_source(quick: bool) -> Iterator[tuple[Path, str]]:
    """(folder with train IDX files, description): ``data/MNIST`` if present (not with
    `quick`), else a random IDX set of the same size (`QUICK_ROWS` with `quick`)."""
    import torch

    from shardwise.dataset.idx import find_idx_file, write_idx

    files = [find_idx_file(MNIST_DIR, "train", kind, ndim) for kind, ndim in KINDS]
    if not quick and all(files):
        yield MNIST_DIR, f"real MNIST ({MNIST_DIR.relative_to(REPO_ROOT)})"
        return
    rows = QUICK_ROWS if quick else MNIST_ROWS
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-mnist-") as tmp:
        write_idx(
            Path(tmp) / "train-images-idx3-ubyte",
            torch.randint(0, 256, (rows, 28, 28), generator=g, dtype=torch.uint8),
        )
        write_idx(Path(tmp) / "train-labels-idx1-ubyte",
                  torch.randint(0, 10, (rows,), generator=g, dtype=torch.uint8))  # fmt: skip
        why = "--quick" if quick else f"{MNIST_DIR.relative_to(REPO_ROOT)} not found"
        yield Path(tmp), f"SYNTHETIC random IDX set of {rows} rows ({why}; `make data` for real)"


# --------------------------------------------------------------------------- pipelines


def shardwise_pipeline(
    directory: Path, workers: int, shuffle: bool = True, sharded: bool = False
) -> Iterable[tuple[torch.Tensor, ...]]:
    """Seed 004's input pipeline (seeded: every call gives the same order)."""
    import torch

    import shardwise as sw
    from shardwise.dataset import transforms, vision

    sw.set_seed(SEED)
    ds = sw.dataset.MnistDataset(
        directory,
        "train",
        shuffle=shuffle,
        num_shards=SHARDS if sharded else None,
        shard_id=0 if sharded else None,
        num_parallel_workers=workers,
    )
    ds = ds.map([vision.Rescale(1.0 / 255.0, 0), vision.Normalize((MEAN,), (STD,)),
                 vision.HWC2CHW()], "image")  # fmt: skip
    ds = ds.map(transforms.TypeCast(torch.int64), "label")
    return ds.batch(SHARD_BATCH if sharded else BATCH)


class TorchMnist:
    """A torchvision-style MNIST ``Dataset``: ``ds[i]`` -> (float image (1, 28, 28), int label),
    ToTensor (/255, add the channel) and Normalize written by hand; ``ds[[i, j, ...]]`` gives
    a whole transformed batch (for a ``BatchSampler`` used as sampler)."""

    def __init__(self, directory: Path) -> None:
        from shardwise.dataset.idx import find_idx_file, read_idx

        images, labels = (find_idx_file(directory, "train", k, d) for k, d in KINDS)
        if images is None or labels is None:
            raise FileNotFoundError(f"no train-images/-labels IDX files in {directory}")
        self.images = read_idx(images)  # (n, 28, 28) uint8
        self.labels = read_idx(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int | list[int]) -> tuple[torch.Tensor, Any]:
        import torch

        if isinstance(index, list):
            x = self.images[index].unsqueeze(1).to(torch.float32).div(255.0)
            return (x - MEAN) / STD, self.labels[index].to(torch.int64)
        x = self.images[index].unsqueeze(0).to(torch.float32).div(255.0)  # ToTensor
        return (x - MEAN) / STD, int(self.labels[index])  # Normalize; collate -> int64


def torch_loader(data: TorchMnist, workers: int, batched: bool) -> Iterable[Any]:
    """``DataLoader`` over `data`: per-sample (``batch_size=32``) or one index list per batch."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    if not batched:
        return DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=workers)  # type: ignore[arg-type]
    sampler = BatchSampler(RandomSampler(range(len(data))), BATCH, drop_last=False)
    return DataLoader(data, batch_size=None, sampler=sampler, num_workers=workers)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the worker


@dataclass
class _Epochs:
    """Runs epochs of one pipeline and remembers what they yielded."""

    source: Iterable[Any]
    rows: int = 0
    batches: int = 0
    first_s: list[float] = field(default_factory=list)

    def __call__(self) -> None:
        rows = batches = 0
        start = time.perf_counter()
        for i, (_, label) in enumerate(self.source):
            if i == 0:
                self.first_s.append(time.perf_counter() - start)
            rows, batches = rows + len(label), batches + 1
        self.rows, self.batches = rows, batches


def _check_values(directory: Path) -> bool:
    """The first unshuffled batch of shardwise equals both torch versions' (values, dtypes)."""
    import torch

    sw_x, sw_y = next(iter(shardwise_pipeline(directory, 0, shuffle=False)))
    data = TorchMnist(directory)
    items = [data[i] for i in range(BATCH)]
    per_x, per_y = torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])
    bat_x, bat_y = data[list(range(BATCH))]
    return all(
        x.shape == sw_x.shape and torch.allclose(x, sw_x, atol=1e-6) and torch.equal(y, sw_y)
        for x, y in ((per_x, per_y), (bat_x, bat_y))
    )


def _check_shards(directory: Path) -> bool:
    """Shards 0..3 (batch 8) side by side give the unsharded epoch (batch 32), batch by batch."""
    import torch

    import shardwise as sw

    def raw(shard: int | None) -> Any:
        sw.set_seed(SEED)
        if shard is None:
            return sw.dataset.MnistDataset(directory, "train").batch(BATCH)
        ds = sw.dataset.MnistDataset(directory, "train", num_shards=SHARDS, shard_id=shard)
        return ds.batch(SHARD_BATCH)

    whole = list(raw(None))
    shards = [list(raw(r)) for r in range(SHARDS)]
    if any(len(s) != len(whole) for s in shards):
        return False
    for b, (x, y) in enumerate(whole):
        parts = [s[b] for s in shards]
        got_x, got_y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        rows = len(y)  # a short last batch: the shards wrap around, keep its real rows
        if not (torch.equal(got_x[:rows], x) and torch.equal(got_y[:rows], y)):
            return False
    return True


def _time_group(directory: Path, data: TorchMnist, workers: int, quick: bool) -> list[LoadResult]:
    """Time the four pipelines at one worker count, alternating, one epoch per call."""
    epochs = {
        "shardwise": _Epochs(shardwise_pipeline(directory, workers)),
        "torch per-sample": _Epochs(torch_loader(data, workers, batched=False)),
        "torch batched": _Epochs(torch_loader(data, workers, batched=True)),
        "shardwise sharded": _Epochs(shardwise_pipeline(directory, workers, sharded=True)),
    }
    reps = 1 if quick else (5 if workers == 0 else 3)
    m = compare(epochs, iters=1, reps=reps, warmup=1 if workers == 0 else 0)
    batch = {"shardwise sharded": SHARD_BATCH}
    return [
        LoadResult(
            pipeline=name,
            workers=workers,
            batch=batch.get(name, BATCH),
            rows=e.rows,
            batches=e.batches,
            epoch_s=m[name].median_s,
            first_batch_s=sorted(e.first_s)[len(e.first_s) // 2],
            reps=reps,
        )
        for name, e in epochs.items()
    ]


def worker(args: dict[str, Any]) -> dict[str, Any]:
    """Checks, then every pipeline at 0 and 2 workers (a 1-rank job)."""
    directory = Path(args["data_dir"])
    checks = {"values": _check_values(directory), "shards": _check_shards(directory)}
    data = TorchMnist(directory)
    rows = [asdict(r) for w in WORKERS for r in _time_group(directory, data, w, args["quick"])]
    return {"checks": checks, "total_rows": len(data), "rows": rows}


# --------------------------------------------------------------------------- the parent


def _ratio(r: LoadResult, base: dict[tuple[str, int], LoadResult], name: str) -> str:
    if r.pipeline != "shardwise":
        return "-"
    return f"{r.epoch_s / base[(name, r.workers)].epoch_s:.2f}"


def _note(r: LoadResult, base: dict[tuple[str, int], LoadResult], total: int) -> str:
    if r.pipeline != "shardwise sharded":
        return ""
    whole = base[("shardwise", r.workers)]
    return (
        f"rows {r.rows / total:.2f}, batches {r.batches / whole.batches:.2f}x, "
        f"time {r.epoch_s / whole.epoch_s:.2f}x"
    )


def table(rows: list[LoadResult], total: int, source: str) -> Table:
    """One line per (worker count, pipeline)."""
    base = {(r.pipeline, r.workers): r for r in rows}
    t = Table(
        f"Data loading, MNIST train split ({total} rows), 1 process: one epoch per call",
        ["pipeline", "workers", "batch", "rows/epoch", "batches", "epoch ms", "1st batch ms",
         "samples/s", "sw/torch per-sample", "sw/torch batched", "sharded vs unsharded"],
    )  # fmt: skip
    for i, r in enumerate(rows):
        if i and r.workers != rows[i - 1].workers:
            t.rows.append([])
        t.rows.append(
            [r.pipeline, str(r.workers), str(r.batch), str(r.rows), str(r.batches),
             fmt_ms(r.epoch_s), fmt_ms(r.first_batch_s), f"{r.samples_per_s:,.0f}",
             _ratio(r, base, "torch per-sample"), _ratio(r, base, "torch batched"),
             _note(r, base, total)]
        )  # fmt: skip
    return t


def _notes(rows: list[LoadResult], checks: dict[str, bool], source: str) -> list[str]:
    return [
        f"data: {source}",
        f"epoch ms: median of {rows[0].reps} (workers 0) / {rows[-1].reps} (workers 2) epochs, "
        "the pipelines alternating; 1st batch ms: from iter() to the first batch (worker start "
        "included); sw/torch = shardwise epoch time / torch's (< 1: shardwise faster)",
        "transforms: image /255, (x - 0.1307) / 0.3081, HWC -> CHW, label -> int64; shardwise "
        "runs its built-in transforms vectorized over each batch, torch per-sample runs them "
        "in __getitem__ per image (torchvision style), torch batched once per index list",
        f"first batch equal (shardwise vs both torch versions, no shuffle): "
        f"{'yes' if checks['values'] else 'NO'}; {SHARDS} shards x batch {SHARD_BATCH} side by "
        f"side = the unsharded batches of {BATCH}: {'yes' if checks['shards'] else 'NO'}",
        "sharded vs unsharded: what rank 0 of 4 reads (num_shards=4, shard_id=0, batch 8) as a "
        "share of the unsharded pipeline's rows, batches and epoch time (same workers)",
        "workers 2: every batch crosses a process boundary (pickling + shared memory), "
        f"the workers start anew every epoch and share the {os.cpu_count() or 1} cores with "
        "the main process",
    ]


def run(config: BenchConfig) -> str:
    """Run the 1-rank job, print and save the table; return the printed text."""
    with mnist_source(config.quick) as (directory, source):
        args = {"data_dir": str(directory), "quick": config.quick}
        got = spawn("bench.dataloading:worker", 1, args, config.timeout_s)[0]
    rows = [LoadResult(**r) for r in got["rows"]]
    t = table(rows, got["total_rows"], source)
    t.notes = _notes(rows, got["checks"], source)
    text = str(t)
    data = {
        "meta": {**host_info(), "quick": config.quick, "source": source,
                 "cores": os.cpu_count() or 1, "checks": got["checks"]},
        "rows": [{**asdict(r), "samples_per_s": r.samples_per_s} for r in rows],
    }  # fmt: skip
    save_report(config.out_dir, "dataloading", data, text)
    return text
