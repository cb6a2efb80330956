"""GPT-2 (nanoGPT's architecture, plain torch) trained data parallel, or Megatron-style by
sharding propagation, on random tokens: the model ``shardwise plan`` plans for 1,024 devices.

Run a tiny one on 2 workers:
``shardwise run --worker_num 2 --local_worker_num 2 --join True examples/gpt2.py --steps 3``;
plan GPT-2 small (12 layers, 768 wide, 50,304 tokens, 1,024 positions) for 1,024 devices
without any of them: ``shardwise plan --device_num 1024 examples/gpt2.py --size small``.

- ``--size tiny|small``: the model (`SIZES`).
- ``--mode semi_auto`` (default: no annotation, data parallel) or ``sharding_propagation``
  with every block's ``c_attn`` and ``c_fc`` annotated column parallel over ``--mp`` devices
  (the rest follows by propagation: the output projections row parallel).
- ``--batch``: rows per rank (the global batch is ``batch x ranks``); AdamW as nanoGPT's
  ``configure_optimizers`` makes it.
"""

from __future__ import annotations

import argparse

import torch

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init
from shardwise.testing.nanogpt import GPT2

SIZES = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "block_size": 64},
    "small": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50304, "block_size": 1024},
}


def annotate(net: GPT2, dp: int, mp: int) -> None:
    """Column-parallel ``c_attn`` and ``c_fc`` in every block (``nn.Linear``: input rows over
    dp, weight rows (output features) over mp)."""
    for block in net.transformer["h"]:  # type: ignore[union-attr]
        sw.shard(block.attn.c_attn, in_strategy=((dp, 1), (mp, 1)))
        sw.shard(block.mlp.c_fc, in_strategy=((dp, 1), (mp, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument(
        "--mode", choices=["semi_auto", "sharding_propagation"], default="semi_auto"
    )
    parser.add_argument("--mp", type=int, default=2, help="devices splitting c_attn / c_fc")
    parser.add_argument("--batch", type=int, default=2, help="rows per rank")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    init()
    n, rank = get_group_size(), get_rank()
    sizes = SIZES[args.size]
    sw.set_seed(1)  # (every rank builds the same weights)
    net = GPT2(**sizes)
    if args.mode == "sharding_propagation":
        if n % args.mp:
            raise SystemExit(f"--mp {args.mp} must divide the {n} devices")
        annotate(net, n // args.mp, args.mp)
    optimizer = net.configure_optimizers(weight_decay=0.1, lr=6e-4)

    def train_step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, loss = net(idx, targets)
        assert loss is not None
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    parallel_step = sw.AutoParallel(train_step, parallel_mode=args.mode)
    g = torch.Generator().manual_seed(1234 + rank)  # (this rank's rows of the global batch)
    seq = sizes["block_size"]
    for step in range(args.steps):
        tokens = torch.randint(0, sizes["vocab_size"], (args.batch, seq + 1), generator=g)
        loss = parallel_step(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        if rank == 0:
            print(f"step {step}: loss {float(loss.detach()):.6f}", flush=True)
    sw.communication.release()


if __name__ == "__main__":
    main()
