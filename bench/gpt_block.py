"""A GPT-style block, Megatron tensor parallel: shardwise AutoParallel vs DTensor vs one process.

For every N (default 2 and 4; 8 only when asked, oversubscribed on 2 cores) one gloo job runs
`worker`. The network is ``shardwise.testing.models.GPTBlock`` (vocab-parallel embedding,
causal multi-head attention, GeLU MLP, two LayerNorms, head, softmax cross entropy against
one-hot targets, mean over the tokens) with `CONFIG` (`QUICK_CONFIG` with ``--quick``), dropout
off (``keep_prob=1.0``: its mask generation would dominate the step and the DTensor port could
not reproduce shardwise's masks), on a global batch of `GLOBAL_BATCH` sequences (synthetic
tokens from `gpt_batches`, the same on every rank), SGD lr `LR`. Candidates, per layout
``dp x mp`` (``1 x N`` always: pure tensor parallel; ``2 x N/2`` too for N >= 4):

- ``shardwise``: ``sw.AutoParallel(train_step)`` on ``GPTBlock(cfg, megatron_strategies(dp,
  mp))``, the train-step form (forward, ``loss.backward()``, SGD inside the wrapped call, as
  MindSpore's ``TrainOneStepCell``): each rank passes its rows of the ids and of the one-hot
  targets and gets the global mean loss;
- ``DTensor``: `TorchGPTBlock`, an ``nn.Module`` port of the same block (``nn.Embedding``,
  ``nn.Linear``, ``nn.LayerNorm``, tanh GeLU) with the same weights, parallelized with
  ``parallelize_module`` on the ``mp`` dim of an ``init_device_mesh("cpu", (dp, mp))`` mesh
  (`tp_plan`): the embedding ``RowwiseParallel(input_layouts=Shard(0))`` (rows sharded, the
  ids rows all-gathered, masked lookup + all-reduce), q / k / v / fc1 ``ColwiseParallel``
  (``Shard(1)`` of the ``[in, out]`` weight), wo / fc2 ``RowwiseParallel``, attention on the
  local heads (the attention input prepared once with ``PrepareModuleInput``, torchtitan's
  pattern), the head ``ColwiseParallel(output_layouts=Shard(0))`` (logits from vocab columns to
  token rows: shardwise's layout for the loss; DTensor redistributes that with an all-gather +
  slice, forward and backward, where shardwise uses an all-to-all), local cross entropy summed /
  (B*S), the loss value all-reduced once; with dp > 1 the gradients all-reduced over dp in one
  flat buffer (what DDP's single bucket would do);
- ``one process``: the port unparallelized, rank 0 alone on the whole batch (faster of 1 thread
  and all cores).

`_check` trains fresh copies `CHECK_STEPS` steps and compares the losses (and DTensor's full
parameters with the one-process ones). Communication is accounted as in
``bench.operator_parallel`` (`CommRecorder` for shardwise, the ``CollectiveSpy`` dispatch
mode priced with ``bytes_bound`` for DTensor) and set against `megatron_bound`, the minimum of
the layout. `harness.compare` times the candidates side by side; `run` prints three tables and
saves ``gpt_block.json`` / ``gpt_block.txt``.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

from bench import _common as common
from bench import harness
from bench._common import chunk, n_label, ratio
from bench.harness import BenchConfig, Table, compare, fmt_bytes, fmt_ms

if TYPE_CHECKING:
    import torch

    from shardwise.testing.models import GPTBlock, GPTConfig

# GPTConfig fields (vocab, seq, hidden, heads, ffn, keep_prob) as plain tuples: this module is
# imported by the parent, which does not import torch.
CONFIG = (512, 64, 256, 8, 1024, 1.0)
QUICK_CONFIG = (64, 8, 64, 8, 128, 1.0)
GLOBAL_BATCH = 8
LR = 0.1
POOL = 4  # distinct global batches, cycled through
CHECK_STEPS = 3
CHECK_ATOL = 1e-4  # float32 sums over 512 logits / 1024 MLP columns in a different order
ALLOWED_RANKS = (2, 4, 8)
Step = Callable[[], "torch.Tensor"]  # one training step; returns the global mean loss


def gpt_config(quick: bool) -> GPTConfig:
    from shardwise.testing.models import GPTConfig

    return GPTConfig(*(QUICK_CONFIG if quick else CONFIG))


def layouts(n: int) -> list[tuple[int, int]]:
    """The ``(dp, mp)`` grids timed at N = n: pure tensor parallel, and 2 x n/2 from 4 on."""
    return [(1, n)] + ([(2, n // 2)] if n >= 4 else [])


@dataclass(frozen=True, kw_only=True)
class GPTResult(common.TPResult):
    """One N and one ``dp x mp`` layout: times, the check, communication of one step (the
    shared fields: `common.TPResult`)."""

    dp: int
    mp: int
    bound_bytes: int  # `megatron_bound`
    bound_collectives: int

    @property
    def equal(self) -> bool:
        return self.worst_diff <= CHECK_ATOL

    @property
    def sw_bytes(self) -> int:
        return self.sw_fwd_bytes + self.sw_bwd_bytes


# --------------------------------------------------------------------------- the bound


BOUND_FORMULA = (
    "bound per rank per step, T = B*S tokens, n = dp*mp, AR/AG/A2A = bytes_bound of AllReduce / "
    "AllGather / AlltoAll: 6 AR_mp(T/dp x H fp32) [forward: embedding, wo, fc2 outputs; "
    "backward: the gradients at the q/k/v, fc1 and head inputs] + 2 A2A_mp(T/dp x V/mp fp32) "
    "[logits vocab columns -> token rows, and back] + AG_mp(T/n int64 ids) + AR_n(4 B) [the "
    "loss value] + (dp > 1) AR_dp(every parameter's mp-block) [one gradient bucket]"
)


def megatron_bound(cfg: GPTConfig, batch: int, dp: int, mp: int) -> tuple[int, int]:
    """The minimum of the Megatron layout ``dp x mp`` per rank per step: (bytes, collectives).

    See `BOUND_FORMULA`. Replicated parameters (position, LayerNorms) need no gradient
    communication over mp: Megatron's backward all-reduces make their gradients whole.
    """
    from shardwise.communication import bytes_bound

    t, h, v, f, s = batch * cfg.seq, cfg.hidden, cfg.vocab, cfg.ffn, cfg.seq
    act = t // dp * h * 4
    logits = t // dp * v // mp * 4
    ids = t // (dp * mp) * 8
    total = 6 * bytes_bound("AllReduce", act, mp) + 2 * bytes_bound("AlltoAll", logits, mp)
    total += bytes_bound("AllGather", ids, mp) + bytes_bound("AllReduce", 4, dp * mp)
    colls = 6 + 2 + 1 + 1
    if dp > 1:
        sharded = v * h + 4 * h * h + h * f + f + f * h + h * v  # split over mp
        replicated = s * h + 4 * h  # position, ln1 / ln2 gamma and beta
        total += bytes_bound("AllReduce", (sharded // mp + replicated) * 4, dp)
        colls += 1
    return total, colls


# --------------------------------------------------------------------------- the networks


def make_net(cfg: GPTConfig, dp: int, mp: int) -> GPTBlock:
    """shardwise's `GPTBlock` with the Megatron strategies of ``dp x mp`` (seed 0 weights)."""
    from shardwise.testing.models import GPTBlock, megatron_strategies

    return GPTBlock(cfg, megatron_strategies(dp, mp))


def _torch_block_class() -> type[torch.nn.Module]:
    """`TorchGPTBlock` (built lazily: torch is imported in the workers only)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        """Causal multi-head attention on ``[B*S, H]`` rows, as many heads as q's (local)
        width holds (the same code serves the tensor-parallel port), then ``o``."""

        def __init__(self, cfg: GPTConfig) -> None:
            super().__init__()
            h, s = cfg.hidden, cfg.seq
            self.seq, self.dh = s, h // cfg.heads
            self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
            self.causal_bias: torch.Tensor
            self.register_buffer("causal_bias", torch.full((s, s), -1e9).triu(1))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            batch, s = h.shape[0] // self.seq, self.seq

            def split(t: torch.Tensor) -> torch.Tensor:  # [B*S, heads*dh] -> [B, heads, S, dh]
                return t.reshape(batch, s, -1, self.dh).transpose(1, 2)

            q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
            scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.dh)) + self.causal_bias
            ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch * s, -1)
            out: torch.Tensor = self.o(ctx)
            return out

    class TorchGPTBlock(nn.Module):
        """`GPTBlock` as a PyTorch user writes it: ``nn.Embedding`` / ``nn.Linear`` /
        ``nn.LayerNorm`` modules, an `Attention` submodule, tanh GeLU, no dropout;
        ``forward(ids)`` returns the logits (the loss is taken by the caller, on whatever rows
        it holds)."""

        def __init__(self, cfg: GPTConfig) -> None:
            super().__init__()
            h, f, v, s = cfg.hidden, cfg.ffn, cfg.vocab, cfg.seq
            self.embedding = nn.Embedding(v, h)
            self.position = nn.Parameter(torch.zeros(s, h))
            self.ln1, self.ln2 = nn.LayerNorm(h, eps=1e-5), nn.LayerNorm(h, eps=1e-5)
            self.attn = Attention(cfg)
            self.fc1, self.fc2 = nn.Linear(h, f), nn.Linear(f, h, bias=False)
            self.head = nn.Linear(h, v, bias=False)

        @torch.no_grad()
        def load_from(self, ref: GPTBlock) -> TorchGPTBlock:
            """Copy `ref`'s weights (its matmul weights are ``[in, out]``: transposed here)."""
            self.embedding.weight.copy_(ref.embedding)
            self.position.copy_(ref.position)
            for ln, name in ((self.ln1, "ln1"), (self.ln2, "ln2")):
                ln.weight.copy_(getattr(ref, f"{name}_gamma"))
                ln.bias.copy_(getattr(ref, f"{name}_beta"))
            a = self.attn
            pairs = [(a.q, "wq"), (a.k, "wk"), (a.v, "wv"), (a.o, "wo")]
            pairs += [(self.fc1, "w1"), (self.fc2, "w2"), (self.head, "w_head")]
            for lin, name in pairs:
                lin.weight.copy_(getattr(ref, name).t())
            self.fc1.bias.copy_(ref.b1)
            return self

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embedding(ids) + self.position  # [B, S, H]
            x = x.reshape(x.shape[0] * x.shape[1], -1)
            x = x + self.attn(self.ln1(x))
            h = self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
            out: torch.Tensor = self.head(x + h)
            return out

    return TorchGPTBlock


def torch_block(cfg: GPTConfig) -> torch.nn.Module:
    """A `TorchGPTBlock` with the weights of shardwise's `GPTBlock` (seed 0)."""
    model: torch.nn.Module = _torch_block_class()(cfg)
    cast(Any, model).load_from(make_net(cfg, 1, 1))
    return model


def xent_sum(logits: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
    """Sum over the rows of ``-(onehot * log_softmax(logits)).sum(-1)`` (shardwise's
    SoftmaxCrossEntropyWithLogits, summed)."""
    return -(onehot * logits.log_softmax(-1)).sum()


def tp_plan() -> dict[str, Any]:
    """The ``parallelize_module`` plan of `TorchGPTBlock` on the mp mesh dim (Megatron)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    return {
        "embedding": RowwiseParallel(input_layouts=Shard(0)),  # ids rows -> all-gathered
        # the attention input as one Replicate DTensor (torchtitan's pattern): q / k / v's
        # Partial input gradients add up and are all-reduced once, not once per projection
        "attn": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate()),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Shard(0)),  # vocab columns -> token rows
    }


# --------------------------------------------------------------------------- data


def _data(cfg: GPTConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from shardwise.testing.models import gpt_batches

    return gpt_batches(cfg, GLOBAL_BATCH, POOL)


def _batches(cfg: GPTConfig, part: int, parts: int) -> Callable[[], tuple[Any, Any]]:
    """Each call: the next global batch's `part`-th of `parts` row blocks (ids, one-hot)."""
    pool, counter = _data(cfg), itertools.count()

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ids, onehot = pool[next(counter) % POOL]
        b, t = ids.shape[0] // parts, onehot.shape[0] // parts
        return ids[part * b : (part + 1) * b], onehot[part * t : (part + 1) * t]

    return next_batch


# --------------------------------------------------------------------------- the candidates


def shardwise_step(cfg: GPTConfig, dp: int, mp: int, rank: int) -> tuple[Any, Step]:
    """``AutoParallel(train_step)`` (the train-step form: forward, ``loss.backward()`` and the
    SGD step inside the wrapped call) on this rank's rows; returns the global loss."""
    import torch

    from shardwise.parallel import AutoParallel

    net = make_net(cfg, dp, mp)
    opt = torch.optim.SGD(net.parameters(), LR)
    batch = _batches(cfg, rank, dp * mp)

    def train_step(ids: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = net(ids, onehot)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    parallel = AutoParallel(train_step)

    def step() -> torch.Tensor:
        loss: torch.Tensor = parallel(*batch())
        return loss.detach()

    return net, step


def dtensor_step(cfg: GPTConfig, dp: int, mp: int, rank: int) -> tuple[Any, Step]:
    """`TorchGPTBlock` parallelized with `tp_plan` on mesh dim ``mp`` of a ``(dp, mp)`` mesh;
    the gradients all-reduced over ``dp`` in one flat buffer when dp > 1."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (dp, mp), mesh_dim_names=("dp", "mp"))
    model = torch_block(cfg)
    parallelize_module(model, mesh["mp"], tp_plan())
    params = list(model.parameters())
    opt = torch.optim.SGD(params, LR)
    dp_group = mesh.get_group("dp") if dp > 1 else None
    batch, tokens = _batches(cfg, rank, dp * mp), GLOBAL_BATCH * cfg.seq

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def step() -> torch.Tensor:
        ids, onehot = batch()
        loss = xent_sum(model(ids), onehot) / tokens  # this rank's rows' share of the mean
        loss.backward()
        if dp_group is not None:
            grads = [local(p.grad) for p in params if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        return value

    return model, step


def single_step(cfg: GPTConfig) -> tuple[Any, Step]:
    """The port in one process on the whole batch, plain PyTorch."""
    import torch

    model = torch_block(cfg)
    opt = torch.optim.SGD(model.parameters(), LR)
    batch, tokens = _batches(cfg, 0, 1), GLOBAL_BATCH * cfg.seq

    def step() -> torch.Tensor:
        ids, onehot = batch()
        loss = xent_sum(model(ids), onehot) / tokens
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return model, step


# --------------------------------------------------------------------------- the worker


def _check(cfg: GPTConfig, dp: int, mp: int, rank: int) -> tuple[float, float, float, list[float]]:
    """`common.check_three` on fresh shardwise / DTensor / one-process copies, `CHECK_STEPS`
    steps."""
    from torch.distributed.tensor import DTensor

    (_, sw), (dt_model, dt) = shardwise_step(cfg, dp, mp, rank), dtensor_step(cfg, dp, mp, rank)
    single_model, single = single_step(cfg)

    def dt_full() -> list[torch.Tensor]:
        return [p.full_tensor() if isinstance(p, DTensor) else p for p in dt_model.parameters()]

    return common.check_three(sw, dt, single, dt_full, single_model.parameters(), rank, CHECK_STEPS)


def worker(args: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Check, account and time every layout of this job's N; rank 0 returns `GPTResult`s."""
    import torch.distributed as dist

    atexit.register(common.exit_quietly)
    n, rank, quick = dist.get_world_size(), dist.get_rank(), bool(args["quick"])
    cfg = gpt_config(quick)
    steps, reps = (2, 2) if quick else (5, 15)
    grids = layouts(n)
    checks = {g: _check(cfg, *g, rank) for g in grids}
    sw = {g: shardwise_step(cfg, *g, rank)[1] for g in grids}
    dt = {g: dtensor_step(cfg, *g, rank)[1] for g in grids}
    _, single = single_step(cfg)
    acc: dict[tuple[int, int], dict[str, Any]] = {}
    for g in grids:
        for _ in range(2):
            sw[g](), dt[g]()
        acc[g] = common.tp_accounting(sw[g], dt[g], steps)
    threads = common.fastest_threads(chunk(single, 1), rank, 2 if quick else 5)
    candidates: dict[str, Callable[[], object]] = {}
    for dp, mp in grids:
        candidates[f"shardwise {dp}x{mp}"] = chunk(sw[dp, mp], steps)
        candidates[f"DTensor {dp}x{mp}"] = chunk(dt[dp, mp], steps)
    candidates["one process"] = chunk(single, steps, threads) if rank == 0 else lambda: None
    m = compare(candidates, iters=1, reps=reps, warmup=1, barrier=harness.barrier_bytes())
    if rank != 0:
        return None

    def lo(name: str) -> float | None:
        value = m[name].median_lo_bytes
        return None if value is None else value / steps

    out = []
    for dp, mp in grids:
        diff_dt, diff_single, diff_params, losses = checks[dp, mp]
        bound, bound_colls = megatron_bound(cfg, GLOBAL_BATCH, dp, mp)
        result = GPTResult(
            world_size=n, dp=dp, mp=mp, shardwise_s=m[f"shardwise {dp}x{mp}"].median_s / steps,
            dtensor_s=m[f"DTensor {dp}x{mp}"].median_s / steps,
            single_s=m["one process"].median_s / steps, single_threads=threads,
            diff_dtensor=diff_dt, diff_single=diff_single, diff_dt_params=diff_params,
            bound_bytes=bound, bound_collectives=bound_colls,
            lo_shardwise_bytes=lo(f"shardwise {dp}x{mp}"),
            lo_dtensor_bytes=lo(f"DTensor {dp}x{mp}"),
            steps_per_call=steps, reps=reps, oversubscribed=n > (os.cpu_count() or 1),
            losses=losses, **acc[dp, mp],
            sw_dt_ratio=common.paired(m[f"shardwise {dp}x{mp}"], m[f"DTensor {dp}x{mp}"]),
        )  # fmt: skip
        out.append(asdict(result))
    return out


# --------------------------------------------------------------------------- the parent


def _describe(cfg: GPTConfig) -> str:
    return (
        f"vocab {cfg.vocab}, seq {cfg.seq}, hidden {cfg.hidden}, heads {cfg.heads}, ffn "
        f"{cfg.ffn}, batch {GLOBAL_BATCH} ({GLOBAL_BATCH * cfg.seq} tokens), keep_prob "
        f"{cfg.keep_prob:g} (dropout off)"
    )


def time_table(rows: list[GPTResult], cfg: GPTConfig) -> Table:
    t = Table(
        f"GPT block ({_describe(cfg)}): time per training step",
        ["N", "dp x mp", "shardwise ms", "DTensor ms", "one process ms", "sw/DT", "sw/one",
         "DT/one", "losses sw = DT = one (max |diff|)"],
    )  # fmt: skip
    for r in rows:
        worst = r.worst_diff
        t.rows.append(
            [n_label(r), f"{r.dp}x{r.mp}", fmt_ms(r.shardwise_s), fmt_ms(r.dtensor_s),
             f"{fmt_ms(r.single_s)} ({r.single_threads}t)", r.sw_dt,
             ratio(r.shardwise_s, r.single_s), ratio(r.dtensor_s, r.single_s),
             f"{'yes' if r.equal else 'NO'} ({worst:.1e})"]
        )  # fmt: skip
    return t


def comm_table(rows: list[GPTResult]) -> Table:
    t = Table(
        "GPT block: communication per step per rank",
        ["N", "dp x mp", "bound", "sw fwd", "sw bwd", "sw total", "DT total", "sw/bound",
         "DT/bound", "lo sw", "lo DT", "colls bound", "colls sw", "colls DT"],
    )  # fmt: skip
    for r in rows:
        t.rows.append(
            [n_label(r), f"{r.dp}x{r.mp}", fmt_bytes(r.bound_bytes), fmt_bytes(r.sw_fwd_bytes),
             fmt_bytes(r.sw_bwd_bytes), fmt_bytes(r.sw_bytes), fmt_bytes(r.dt_bytes),
             ratio(r.sw_bytes, r.bound_bytes), ratio(r.dt_bytes, r.bound_bytes),
             fmt_bytes(r.lo_shardwise_bytes), fmt_bytes(r.lo_dtensor_bytes),
             str(r.bound_collectives), str(r.sw_collectives), str(r.dt_collectives)]
        )  # fmt: skip
    return t


def split_table(rows: list[GPTResult]) -> Table:
    t = Table(
        "GPT block: shardwise step = its collectives + the rest",
        ["N", "dp x mp", "shardwise ms", "collectives ms", "rest ms", "DTensor ms",
         "one process ms / N"],
    )  # fmt: skip
    for r in rows:
        t.rows.append(
            [n_label(r), f"{r.dp}x{r.mp}", fmt_ms(r.shardwise_s), fmt_ms(r.sw_comm_s),
             fmt_ms(r.shardwise_s - r.sw_comm_s), fmt_ms(r.dtensor_s),
             fmt_ms(r.single_s / r.world_size)]
        )  # fmt: skip
    return t


def _notes(rows: list[GPTResult], cores: int) -> list[str]:
    r0 = rows[0]
    notes = [
        f"ms: per step (forward + backward + SGD step), median of {r0.reps} repetitions of "
        f"{r0.steps_per_call} steps, max over ranks; all candidates of one N alternate within "
        "one job. sw/DT > 1: shardwise slower; sw/DT is the median of the repetitions' paired "
        "ratios (95 % interval in brackets: one holding 1.00 cannot tell the two apart here). "
        "one process: rank 0 alone on the whole batch "
        "(the PyTorch port, no parallelism), (kt) = the faster of 1 thread and all cores; "
        "each parallel rank runs cores/N torch threads",
        "DTensor: parallelize_module on the mp dim of a (dp, mp) mesh; embedding rows SHARDED "
        "(RowwiseParallel, masked lookup + all-reduce), q/k/v/fc1 ColwiseParallel, wo/fc2 "
        "RowwiseParallel, head ColwiseParallel(output_layouts=Shard(0)) (logits to token rows, "
        "shardwise's loss layout; DTensor does Shard(1) -> Shard(0) as an all-gather + slice, "
        "forward and backward, where shardwise uses an all-to-all), attention on the local "
        "heads, q/k/v's input prepared once (PrepareModuleInput); dp > 1: gradients "
        "all-reduced over dp in one flat buffer",
        f"losses: fresh copies trained {CHECK_STEPS} steps on the same batches; yes = every loss "
        f"(and every DTensor parameter vs one process) within {CHECK_ATOL:g}",
        BOUND_FORMULA,
        "sw fwd / bwd: CommRecorder's bytes per rank (each collective's bytes_bound), by phase; "
        "DT total: DTensor's collectives seen by a dispatch mode (bench.operator_parallel's "
        "CollectiveSpy), priced with the same bytes_bound; lo: measured loopback bytes per rank "
        "per step (TCP/IP headers, gloo control messages included)",
        "collectives ms: CommRecorder's wall time of shardwise's collectives per step, each "
        "call's minimum over ranks, summed; rest = local compute + shardwise's per-primitive "
        "work (approximate)",
    ]
    return notes + common.oversubscribed_notes(rows, cores)


def calls_text(rows: list[GPTResult]) -> str:
    """Each (N, layout)'s collectives in order: shardwise's, then DTensor's."""
    return common.calls_text(
        line
        for r in rows
        for line in (
            f"N={n_label(r)} {r.dp}x{r.mp} shardwise: {r.sw_calls}",
            f"N={n_label(r)} {r.dp}x{r.mp} DTensor:   {r.dt_calls}",
        )
    )


def ranks_for(config: BenchConfig) -> tuple[int, ...]:
    """N = 2, 4 for the default ``--ranks``; otherwise ``--ranks`` (each of 2, 4, 8)."""
    why = "gpt_block: --ranks {bad}: allowed are 2, 4, 8 (heads and batch split)"
    return common.ranks_for(config, lambda n: n not in ALLOWED_RANKS, why)


def run(config: BenchConfig) -> str:
    """Spawn one job per N, print and save the tables; return the printed text."""
    jobs = common.jobs("gpt_block", config, ranks_for(config), {"quick": config.quick})
    rows = [GPTResult(**g) for _, got in jobs for g in got[0]]
    cfg = gpt_config(config.quick)
    split = split_table(rows)
    split.notes = _notes(rows, os.cpu_count() or 1)
    text = f"{time_table(rows, cfg)}\n\n{comm_table(rows)}\n\n{split}\n\n{calls_text(rows)}"
    data = {
        "meta": common.report_meta(config, lr=LR, global_batch=GLOBAL_BATCH, config=asdict(cfg),
                                   bound_formula=BOUND_FORMULA),
        "rows": [{**asdict(r), "equal": r.equal, "sw_bytes": r.sw_bytes,
                  "sw_over_dtensor": r.shardwise_s / r.dtensor_s,
                  "sw_over_single": r.shardwise_s / r.single_s,
                  "dt_over_single": r.dtensor_s / r.single_s} for r in rows],
    }  # fmt: skip
    harness.save_report(config.out_dir, "gpt_block", data, text)
    return text
