"""Checks of `sw.Model` on real ranks (run in the 2-process job of two_ranks_worker.py):

- `Model.eval` on a dataset sharded over the ranks: the short last global batch leaves rank 1
  only wrap-around padding, which eval trims away; the "loss" metric was NaN there (the mean
  loss of an empty batch) and, on an uneven last batch, each rank's part counted as a whole
  batch. Both equal one device's eval of the same global batches now. The network runs on the
  whole last batch on every rank (padding included; the metrics count the real rows), so a loss
  that all-reduces and a module-form AutoParallel make the same calls on every rank (both hung).
- `save_checkpoint` of a cut network to a path outside a ``rank_<r>`` folder warns (every rank
  writing one path kept one rank's blocks, silently); a rank folder does not.
- `ModelCheckpoint`'s prefix: an earlier job's files in rank 0's folder only made rank 0 write
  ``m_1-...`` and rank 1 ``m-...`` (each chose alone): one job's checkpoint under two names,
  which `resume` could not load. The ranks agree now.
- `Model.eval` over a torch DataLoader with a ``DistributedSampler`` (11 rows on 2 ranks: rank 1's
  last row is row 0 again) returned each rank's own metrics, padding row counted (0.5 and 0.83
  where one device gives 0.64); the ranks' counts are summed, the padding left out, now.
"""

from __future__ import annotations

import copy
import math
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.dataset import GeneratorDataset


def checks() -> None:
    """Run in a job that has called ``init()``."""
    sharded_eval()
    sampler_eval()
    checkpoint_prefix()
    shared_path_warning()


def sharded_eval() -> None:
    rank, n = sw.communication.get_rank(), sw.communication.get_group_size()
    g = torch.Generator().manual_seed(7)
    rows = [(torch.randn(3, generator=g), torch.randint(0, 2, (), generator=g)) for _ in range(5)]
    torch.manual_seed(1)
    net, loss_fn = nn.Linear(3, 2), nn.CrossEntropyLoss()
    metrics = {"loss", "accuracy"}
    whole = GeneratorDataset(rows, ["x", "y"], shuffle=False).batch(2 * n)
    want = sw.Model(net, loss_fn, metrics=metrics).eval(whole)  # (global batches of 4, then 1)
    mine = GeneratorDataset(rows, ["x", "y"], shuffle=False, num_shards=n, shard_id=rank)
    mine = mine.batch(2)
    assert mine.get_padding() == (1, 2)[rank], mine.get_padding()  # (rank 1: padding only)
    got = sw.Model(net, loss_fn, metrics=metrics).eval(mine)
    assert got["accuracy"] == want["accuracy"], (got, want)
    assert math.isclose(got["loss"], want["loss"], rel_tol=1e-6), (got, want)  # (float32 losses)
    print("CHECK sharded_eval_loss OK", flush=True)

    # the same set, with a loss that all-reduces (the README's manual-parallel loss) and through
    # a module-form AutoParallel: every rank runs the whole last batch (rank 1: padding only),
    # so the ranks make the same calls (both hung: rank 1's rows were cut before the forward)
    def mean_over_ranks(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = sw.ops.AllReduce()(F.cross_entropy(logits, y)) / n
        return loss

    got = sw.Model(net, mean_over_ranks, metrics=metrics).eval(mine)
    assert got["accuracy"] == want["accuracy"], (got, want)
    wrapped = sw.Model(sw.AutoParallel(copy.deepcopy(net)), loss_fn, metrics=metrics).eval(mine)
    assert wrapped["accuracy"] == want["accuracy"], (wrapped, want)
    assert math.isclose(wrapped["loss"], want["loss"], rel_tol=1e-6), (wrapped, want)
    print("CHECK sharded_eval_same_calls OK", flush=True)


def sampler_eval() -> None:
    n = sw.communication.get_group_size()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(11, 3, generator=g), torch.randint(0, 2, (11,), generator=g)
    torch.manual_seed(7)
    net, loss_fn = nn.Linear(3, 2), nn.CrossEntropyLoss()
    data = torch.utils.data.TensorDataset(x, y)
    metrics = {"loss", "accuracy"}
    whole = [(x[i : i + 2 * n], y[i : i + 2 * n]) for i in range(0, 11, 2 * n)]
    want = sw.Model(net, loss_fn, metrics=metrics).eval(whole)  # (the ranks' rows of a step)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    got = sw.Model(net, loss_fn, metrics=metrics).eval(loader)
    assert math.isclose(got["accuracy"], want["accuracy"], rel_tol=1e-12), (got, want)
    assert math.isclose(got["loss"], want["loss"], rel_tol=1e-6), (got, want)
    print("CHECK distributed_sampler_eval OK", flush=True)


def checkpoint_prefix() -> None:
    rank = sw.communication.get_rank()
    name = tempfile.mkdtemp(prefix="sw-prefix-").encode() if rank == 0 else b""
    sent = torch.zeros(256, dtype=torch.uint8)
    sent[: len(name)] = torch.tensor(list(name), dtype=torch.uint8)
    (got,) = sw.ops.Broadcast(0)(sent)  # (rank 0's folder, for the job; a tuple, as MindSpore)
    folder = Path(bytes(got[got > 0].tolist()).decode())
    if rank == 0:  # (an earlier job's file, in rank 0's folder only)
        torch.manual_seed(0)
        sw.save_checkpoint(nn.Linear(2, 2), folder / "rank_0" / "m-1_1.safetensors")
    sw.ops.AllReduce()(torch.zeros(1))  # (the file is there before any rank looks)
    torch.manual_seed(0)
    net = nn.Linear(2, 2)
    model = sw.Model(net, nn.MSELoss(), torch.optim.SGD(net.parameters(), 0.1))
    batch = (torch.zeros(2, 2), torch.zeros(2, 2))
    model.train(1, [batch], callbacks=[sw.train.ModelCheckpoint("m", folder)])
    mine = sorted(p.name for p in (folder / f"rank_{rank}").iterdir() if p.name.startswith("m_1"))
    assert mine == ["m_1-1_1.safetensors"], sorted(p.name for p in folder.rglob("*"))
    print("CHECK checkpoint_prefix_agreed OK", flush=True)


def shared_path_warning() -> None:
    rank, n = sw.communication.get_rank(), sw.communication.get_group_size()
    torch.manual_seed(0)
    net = sw.shard(nn.Linear(4, 4), in_strategy=((1, 1), (n, 1)))  # (column parallel)
    step = sw.AutoParallel(net)
    step(torch.zeros(2, 4))
    folder = Path(tempfile.mkdtemp(prefix=f"sw-shared-{rank}-"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sw.save_checkpoint(net, folder / "net.safetensors")
        sw.save_checkpoint(net, folder / f"rank_{rank}" / "net.safetensors")
    said = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    assert len(said) == 1 and f"holds rank {rank}'s blocks only" in said[0], said
    print("CHECK shared_path_warning OK", flush=True)
