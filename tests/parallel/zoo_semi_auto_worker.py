"""Worker for test_zoo_semi_auto_real.py: nanoGPT's GPT-2 (`tests/zoo.py`) in semi_auto with no
annotation on real gloo processes. Each process passes its own rows of the global batch, trains
2 AdamW steps (decay / no-decay groups) and checks the returned loss, every gradient and every
parameter against the single-device run it computes itself (1e-5 relative), and the collectives
of each step: one forward AllReduce (the loss), one backward AllReduce (every gradient in one
25 MB bucket, started asynchronously). Prints ``CHECK step <k> OK``; a mismatch raises. On 4
processes it then trains the model with Megatron annotations at 2 x 2 (``megatron``) and prints
``CHECK megatron step <k> OK``; then evaluates it under ``torch.inference_mode()`` (``CHECK
inference step <k> OK``); then, with dropout 0.1 (attention and residual) and the step
clipping its gradients by torch's ``clip_grad_norm_``, the same Megatron model and torch's own
``nn.TransformerEncoder`` (attention dropout drawn inside ``F.multi_head_attention_forward``),
each rank's masks drawn as one device draws them from the same seed: ``CHECK dropout <model>
step <k> OK``.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shardwise as sw
from shardwise.communication import get_group_size, get_rank
from shardwise.testing import CommRecorder
from zoo import GPT2, recording_step, token_batches

STEPS, BATCH = 2, 8
ADAM = {"lr": 1e-4, "eps": 1e-6}


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        diff = (got - want).abs().max().item()
        raise AssertionError(f"rank {get_rank()}: {what} differs (max abs diff {diff})")


def train_step(net: GPT2, grads: list[dict[str, torch.Tensor]]) -> Any:
    """The train step (AdamW with decay groups), recording each step's gradients in `grads`."""
    opt = net.configure_optimizers(weight_decay=0.1, **ADAM)
    return recording_step(net, opt, lambda m, x, y: m(x, y)[1], grads)


def reference_step(
    ref: GPT2, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One single-device step on the global batch: its loss and every gradient."""
    want: torch.Tensor = ref(x, y)[1]
    want.backward()
    grads = {name: p.grad.detach().clone() for name, p in ref.named_parameters()}
    opt.step()
    opt.zero_grad()
    return want, grads


def main() -> None:
    sw.communication.init()
    checks()
    sw.communication.release()


def checks() -> None:
    """Every check of this worker, in a job that has called ``init()`` (four_ranks_worker.py
    runs them in the tests' one 4-process job)."""
    rank, n = get_rank(), get_group_size()
    batches = token_batches(STEPS, BATCH)
    ref = GPT2()
    ref_opt = ref.configure_optimizers(weight_decay=0.1, **ADAM)
    net = GPT2()
    grads: list[dict[str, torch.Tensor]] = []
    parallel = sw.AutoParallel(train_step(net, grads), parallel_mode="semi_auto")
    rows = BATCH // n
    for k, (x, y) in enumerate(batches):
        want, want_grads = reference_step(ref, ref_opt, x, y)
        mine = slice(rank * rows, (rank + 1) * rows)
        with CommRecorder() as rec:
            loss = parallel(x[mine], y[mine])
        close(loss.detach(), want.detach(), f"loss {k}")
        for name, g in want_grads.items():
            close(grads[k][name], g, f"gradient of {name}, step {k}")
        for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
            close(p.detach(), q.detach(), f"{name} after step {k}")
        kinds: Counter[tuple[str, str]] = Counter()
        for (kind, phase, _), count in rec.kinds().items():
            kinds[(kind, phase)] += count
        # one gradient bucket (one AllReduce per parameter before)
        assert kinds == Counter({("AllReduce", "forward"): 1, ("AllReduce", "backward"): 1}), (
            rec.summary()
        )
        print(f"CHECK step {k} OK", flush=True)
    if n == 4:
        megatron(batches, rank)
        inference(batches, rank)
        dropout_and_clipping(batches, rank)


def megatron(batches: list[tuple[torch.Tensor, torch.Tensor]], rank: int) -> None:
    """The same model with Megatron annotations at dp x mp = 2 x 2 (column-parallel c_attn /
    c_fc, row-parallel c_proj): the loss, each rank's block of every gradient, and per step
    2 AllGathers, 2 AlltoAlls and 2 ReduceScatters per layer forward (their adjoints backward),
    the loss and two gradient buckets."""
    ref, net = GPT2(), GPT2()
    ref_opt = ref.configure_optimizers(weight_decay=0.1, **ADAM)
    for block in net.transformer.h:
        sw.shard(block.attn.c_attn, in_strategy=((2, 1), (2, 1)))
        sw.shard(block.attn.c_proj, in_strategy=((2, 2), (1, 2)))
        sw.shard(block.mlp.c_fc, in_strategy=((2, 1), (2, 1)))
        sw.shard(block.mlp.c_proj, in_strategy=((2, 2), (1, 2)))
    grads: list[dict[str, torch.Tensor]] = []
    parallel = sw.AutoParallel(train_step(net, grads), parallel_mode="semi_auto")
    rows, layers = BATCH // 4, len(net.transformer.h)
    for k, (x, y) in enumerate(batches):
        want, want_grads = reference_step(ref, ref_opt, x, y)
        mine = slice(rank * rows, (rank + 1) * rows)
        with CommRecorder() as rec:
            loss = parallel(x[mine], y[mine])
        close(loss.detach(), want.detach(), f"megatron loss {k}")
        plan = parallel.parallel_plan
        assert plan is not None
        for name, g in want_grads.items():
            block = g[plan.params[name].layout.local_slice(rank, tuple(g.shape))]
            close(grads[k][name], block, f"megatron gradient of {name}, step {k}")
        kinds: Counter[tuple[str, str]] = Counter()
        for (kind, phase, _), count in rec.kinds().items():
            kinds[(kind, phase)] += count
        want_kinds = Counter(
            {
                ("AllGather", "forward"): 2 * layers,
                ("AlltoAll", "forward"): 2 * layers,
                ("ReduceScatter", "forward"): 2 * layers,  # c_proj twice a layer, to rows
                ("AllReduce", "forward"): 1,  # the loss
                ("ReduceScatter", "backward"): 2 * layers,
                ("AlltoAll", "backward"): 2 * layers,
                ("AllGather", "backward"): 2 * layers,  # (the ReduceScatters' adjoints)
                ("AllReduce", "backward"): 2,  # the two gradient buckets
            }
        )
        assert kinds == want_kinds, rec.summary()
        print(f"CHECK megatron step {k} OK", flush=True)


def inference(batches: list[tuple[torch.Tensor, torch.Tensor]], rank: int) -> None:
    """The Megatron model evaluated under ``torch.inference_mode()`` (where ``F.linear``,
    ``layer_norm`` and the loss reach the planner as single composite ops): each batch's loss
    equals one device's, with the collectives of the same step under ``no_grad``."""
    ref, net = GPT2(), GPT2()
    for block in net.transformer.h:
        sw.shard(block.attn.c_attn, in_strategy=((2, 1), (2, 1)))
        sw.shard(block.attn.c_proj, in_strategy=((2, 2), (1, 2)))
        sw.shard(block.mlp.c_fc, in_strategy=((2, 1), (2, 1)))
        sw.shard(block.mlp.c_proj, in_strategy=((2, 2), (1, 2)))

    def evaluate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            loss: torch.Tensor = net(a, b)[1]
        return loss

    parallel = sw.AutoParallel(evaluate, parallel_mode="semi_auto")
    for k, (x, y) in enumerate(batches):
        with torch.inference_mode():
            want = ref(x, y)[1]
        with CommRecorder() as rec:
            loss = parallel(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])
        close(loss, want, f"inference-mode loss {k}")
        kinds = Counter(kind for (kind, _, _) in rec.kinds().elements())
        want_kinds = {"ReduceScatter": 4, "AllReduce": 1, "AllGather": 4, "AlltoAll": 4}
        assert kinds == Counter(want_kinds), rec.summary()
        print(f"CHECK inference step {k} OK", flush=True)


def dropout_and_clipping(batches: list[tuple[torch.Tensor, torch.Tensor]], rank: int) -> None:
    """Random draws and clipping in real processes: every rank seeds alike, draws each mask
    whole and keeps its block (``F.dropout``, SDPA's math form, the encoder's in-place
    fills); the clipping's partial norms are all-reduced over mp. Loss and every gradient
    block (clipped) equal one device's, step by step from the same random state."""
    import torch.nn.functional as F
    from torch import nn

    from zoo import GPT2Config

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(64, 32)
            layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, norm_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(32, 64)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
            mask = nn.Transformer.generate_square_subsequent_mask(16)
            h = self.enc(self.emb(x), mask=mask, is_causal=True)
            return None, F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    def megatron_gpt2() -> nn.Module:
        net = GPT2(GPT2Config(dropout=0.1))
        for block in net.transformer.h:
            for m, strategy in (("attn.c_attn", ((2, 1), (2, 1))), ("mlp.c_fc", ((2, 1), (2, 1)))):
                sw.shard(block.get_submodule(m), in_strategy=strategy)
            for m in ("attn.c_proj", "mlp.c_proj"):
                sw.shard(block.get_submodule(m), in_strategy=((2, 2), (1, 2)))
        return net

    for name, make in (("gpt2", megatron_gpt2), ("encoder", Encoder)):
        ref, net = make(), make()
        seen: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []

        def step(m: nn.Module, out: list[Any]) -> Any:
            opt = torch.optim.AdamW(m.parameters(), **ADAM)

            def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                loss: torch.Tensor = m(a, b)[1]
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                out.append((norm, {k: p.grad.detach().clone() for k, p in m.named_parameters()}))
                opt.step()
                opt.zero_grad()
                return loss

            return run

        want: list[Any] = []
        ref_step, parallel = step(ref, want), sw.AutoParallel(step(net, seen), "semi_auto")
        torch.manual_seed(7)
        for k, (x, y) in enumerate(batches):
            state = torch.get_rng_state()
            want_loss = ref_step(x, y)
            torch.set_rng_state(state)
            loss = parallel(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])
            close(loss.detach(), want_loss.detach(), f"dropout {name} loss {k}")
            close(seen[k][0], want[k][0], f"dropout {name} norm {k}")
            plan = parallel.parallel_plan
            assert plan is not None
            for key, g in want[k][1].items():
                block = g[plan.params[key].layout.local_slice(rank, tuple(g.shape))]
                close(seen[k][1][key], block, f"dropout {name} gradient of {key}, step {k}")
            print(f"CHECK dropout {name} step {k} OK", flush=True)


if __name__ == "__main__":
    main()
