"""Python ints passed per call and used as an index or slice bound on a tensor the plan holds
whole (``table[n]`` of a whole parameter, ``h[:, :n]`` of an activation tensor parallel keeps
whole, a static KV cache written at ``start_pos``): each call's, as on one device.

They were the first call's on every later call (silently wrong outputs and gradients: the
captured int was taken for a size read from a split tensor's local shape,
`parallel/_sizes.py`). Now only a size that came from a local shape gets the captured one; any
other int that differs from the captured one plans the call again (a plan per int, reused when
it comes back).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

pytestmark = pytest.mark.usefixtures("one_thread")

BOTH = ((0, 1),)  # (the group of both ranks)


def _planned(rec: CommRecorder) -> bool:
    return any("planned again" in m for m, _ in rec.marks)


class _Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(5, 6))
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return self.lin(x + self.table[n])


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
def test_an_index_passed_per_call_is_each_calls(mode: str) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    single, net = _Table(), _Table()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode=mode)
        for call, n in enumerate((1, 3, 0, 1)):  # (3: larger than the captured 1)
            with torch.no_grad(), CommRecorder() as rec:
                want = single(x, n)
                got = torch.cat(world.local_tensors(parallel(world.rows(x), n)), 0)
            assert_matches_single_device(got, want, what=f"{mode} table[{n}], call {call}")
            assert rec.kinds() == Counter()  # (rows in, rows out, the table whole)
            assert _planned(rec) == (call in (1, 2))  # (n=1 again: its plan)


def test_a_slice_bound_passed_per_call_on_a_whole_activation_is_each_calls() -> None:
    class Pool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 6)

        def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))[:, :n].mean(1)

    x = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(1))
    single, net = Pool(), Pool()
    with simulated_world(2) as world:
        world.replicate(net)
        sw.shard(net.a, in_strategy=((1, 1), (2, 1)))  # (column, then row parallel: h whole)
        sw.shard(net.b, in_strategy=((1, 2), (1, 2)))
        parallel = sw.AutoParallel(net).dataset_strategy("full_batch")
        for call, n in enumerate((2, 5, 3, 2)):  # (5: larger than the captured 2)
            with torch.no_grad(), CommRecorder() as rec:
                want = single(x, n)
                outs = world.local_tensors(parallel(world.same(x), n))
            for out in outs:
                assert_matches_single_device(out, want, what=f"h[:, :{n}].mean(1)")
            # (the plan's AllGather and the row-parallel AllReduce; a later call's first
            # attempt, on the last call's plan, stops at the slice after its AllGather)
            gathers = 1 if call == 0 else 2
            assert rec.kinds() == Counter(
                {("AllGather", "forward", BOTH[0]): gathers, ("AllReduce", "forward", BOTH[0]): 1}
            )
            assert _planned(rec) == (call in (1, 2))


def _step(m: nn.Module, opt: torch.optim.Optimizer):  # type: ignore[no-untyped-def]
    def step(x: torch.Tensor, n: int) -> torch.Tensor:
        loss = m.lin(x + m.table[n]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def test_an_index_passed_per_call_to_a_train_step_trains_that_row() -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    single, net = _Table(), _Table()
    one = _step(single, torch.optim.SGD(single.parameters(), lr=0.1))
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(_step(net, torch.optim.SGD(net.parameters(), lr=0.1)))
        for n in (0, 3, 4, 3):
            want = one(x, n)
            with CommRecorder() as rec:
                losses = world.local_tensors(parallel(world.rows(x), n))
            for loss in losses:
                assert_matches_single_device(loss, want.detach(), what=f"loss, table[{n}]")
            everyone = BOTH[0]  # (the mean loss; the gradients' bucket)
            assert rec.kinds() == Counter(
                {("AllReduce", "forward", everyone): 1, ("AllReduce", "backward", everyone): 1}
            )
        for (name, p), q in zip(net.named_parameters(), single.parameters(), strict=True):
            for block in world.local_tensors(p):
                assert_matches_single_device(block, q.detach(), what=name)


class _Cached(nn.Module):
    """One attention layer with a static KV cache in buffers, written at ``start``
    (Meta-Llama style), and its logits for the last position."""

    def __init__(self, vocab: int = 16, c: int = 8, rows: int = 4, most: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.qkv = nn.Embedding(vocab, c), nn.Linear(c, 3 * c)
        self.head = nn.Linear(c, vocab)
        self.register_buffer("ck", torch.zeros(rows, most, c), persistent=False)
        self.register_buffer("cv", torch.zeros(rows, most, c), persistent=False)

    def forward(self, idx: torch.Tensor, start: int) -> torch.Tensor:
        b, t = idx.shape
        q, k, v = self.qkv(self.emb(idx)).chunk(3, -1)
        self.ck[:b, start : start + t] = k
        self.cv[:b, start : start + t] = v
        keys, values = self.ck[:b, : start + t], self.cv[:b, : start + t]
        att = q @ keys.transpose(1, 2) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, start + t, dtype=torch.bool).tril(start)
        att = F.softmax(att.masked_fill(~mask, float("-inf")), -1)
        return self.head(att @ values)[:, -1]


def test_a_static_kv_cache_written_at_start_pos_decodes_as_one_device() -> None:
    prompt = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(0))
    single, net = _Cached(), _Cached()
    calls, inp, start = [], prompt, 0  # (one device's greedy decoding: inputs, logits)
    with torch.no_grad():
        for _ in range(4):
            calls.append((inp, start, single(inp, start)))
            start, inp = start + inp.size(1), calls[-1][2].argmax(-1, keepdim=True)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net)
        for step, (inp, start, want) in enumerate(calls):
            with torch.no_grad(), CommRecorder() as rec:
                got = torch.cat(world.local_tensors(parallel(world.rows(inp), start)), 0)
            assert_matches_single_device(got, want, what=f"logits of step {step}")
            # (k and v gathered whole into the cache; from step 2 the first attempt, on the
            # last step's plan, stops at the write at `start` after gathering k)
            gathers = 2 if step < 2 else 3
            assert rec.kinds() == Counter({("AllGather", "forward", BOTH[0]): gathers})
            assert _planned(rec) == (step > 0)  # (step 1: the input's new shape)
