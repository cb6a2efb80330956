"""`simulated_world(n)`: every rank of an n-rank job in one process.

Built on torch's LocalTensorMode (each tensor holds one value per rank, collectives are computed
exactly across them) and the fake process group. This module holds all of shardwise's private
torch imports. `SimulatedWorld` is also the `communication._sim.Simulator`: it gives each rank
its rank (a per-rank symbolic int); checks that sub-groups tile the world (LocalTensorMode runs a
sub-group collective on every translate of the group at once, like a mesh axis: `_tiles`) and
gives each the process group of its copy holding rank 0; runs a per-rank computation on each
rank's own random stream (`each_rank`); and carries out point-to-point exchanges (`exchange`),
which LocalTensorMode cannot do on its own.
"""

from __future__ import annotations

import sys
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from shardwise.communication import _init, _sim
from shardwise.testing._rank_int import rank_node
from shardwise.testing._replaced import ReplacedParams, parameter_replica
from shardwise.testing._sim_mode import guarded_mode
from shardwise.testing._tiles import check_tiles, tiles


def _private() -> tuple[Any, Any, Any]:
    import torch.testing._internal.distributed.fake_pg as fake_pg
    from torch.distributed._local_tensor import LocalIntNode, LocalTensor, LocalTensorMode

    return fake_pg, (LocalIntNode, LocalTensor), LocalTensorMode


def parts_of(t: torch.Tensor) -> list[tuple[int, torch.Tensor]] | None:
    """Each rank's value of a per-rank tensor kept from a world that has ended (None: `t` is
    a plain tensor)."""
    if not isinstance(t, _private()[1][1]):
        return None
    parts = t._local_tensors
    return [(r, parts[r]) for r in sorted(parts)]


class SimulatedWorld:
    """Handle on a simulated n-rank job (see `simulated_world`)."""

    def __init__(self, world_size: int, mode: Any) -> None:
        self.world_size = world_size
        self.mode = mode
        self._replaced = ReplacedParams()  # (what `replicate` replaced; closed at the exit)
        _, (self._int_node, self._local_tensor), _ = _private()

    # -- per-rank values -------------------------------------------------------------------
    def rank_map(self, fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """A tensor whose value on rank r is ``fn(r)``."""
        out: torch.Tensor = self.mode.rank_map(fn)
        return out

    def outside(self) -> Any:
        """A context in which tensors are plain again (LocalTensorMode paused)."""
        return self.mode.disable()

    def each_rank(self, make: Callable[[int], Any]) -> list[Any]:
        """``make(r)`` for every rank r outside the world, each call drawing from rank r's
        random stream and advancing it (LocalTensorMode keeps one generator state per rank and
        puts it back around each op, which would undo a plain draw; with none kept, every call
        starts from the plain generator's state, which the last call advances)."""
        from torch.distributed import _local_tensor as lt

        states = self.mode._per_rank_rng_states
        values = []
        with self.outside():
            start = lt._get_rng_state()
            for r in range(self.world_size):
                lt._set_rng_state(*states.get(r, start))
                values.append(make(r))
                if r in states:
                    states[r] = lt._get_rng_state()
        return values

    def every_rank(self, t: torch.Tensor, copies: bool = False) -> torch.Tensor:
        """`t` as a per-rank tensor (itself when it is one already); `copies`: each rank its
        own copy (rank 0 keeps `t`), for a value the ranks update apart."""
        if isinstance(t, self._local_tensor):
            held: torch.Tensor = t
            return held
        with self.outside():
            parts = [t if r == 0 or not copies else t.clone() for r in range(self.world_size)]
        return self.rank_map(lambda r: parts[r])

    def draw_state(self) -> Any:
        """The per-rank generator states `draw_same` draws from (the plain generator's when the
        world was not seeded inside)."""
        from torch.distributed import _local_tensor as lt

        states = self.mode._per_rank_rng_states
        if states:
            return dict(states)
        with self.outside():
            return lt._get_rng_state()

    def set_draw_state(self, state: Any) -> None:
        """Put back a state `draw_state` returned."""
        from torch.distributed import _local_tensor as lt

        self.mode._per_rank_rng_states.clear()  # (seeded inside since: back to the plain one)
        if isinstance(state, dict):
            self.mode._per_rank_rng_states.update(state)
            return
        with self.outside():
            lt._set_rng_state(*state)

    def draw_same(self, draw: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Draw once outside the world and hand the value to every rank, advancing the random
        stream every rank sees (LocalTensorMode keeps one generator state per rank once seeded
        inside the world and restores it around each op, which would undo a plain draw)."""
        from torch.distributed import _local_tensor as lt

        states = self.mode._per_rank_rng_states
        with self.outside():
            if states:
                lt._set_rng_state(*states[min(states)])
            value = draw()
            if states:
                after = lt._get_rng_state()
                for r in list(states):
                    states[r] = after
        return self.rank_map(lambda r: value.clone())

    def same(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (made outside the world) as a value held by every rank.

        Make data outside the world: inside, random factories draw once per rank (the same
        numbers on every rank only when the world was seeded inside, or with a ``generator=``).
        """
        if isinstance(t, self._local_tensor):
            raise ValueError("same(): the tensor already holds per-rank values; make it outside")
        return self.rank_map(lambda r: t.clone())

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """Each rank's rows of a global batch `t` (made outside the world): dim 0 split into
        equal parts, rank r holding part r, as a dataset read with ``num_shards=n,
        shard_id=r`` gives them (what a wrapped call takes under ``"data_parallel"``).

        Raises:
            ValueError: dim 0 does not divide by the world size.
        """
        if isinstance(t, self._local_tensor):
            raise ValueError("rows(): the tensor already holds per-rank values; make it outside")
        n = self.world_size
        if t.dim() == 0 or t.shape[0] % n:
            raise ValueError(f"rows(): dim 0 of shape {list(t.shape)} does not split into {n}")
        k = t.shape[0] // n
        return self.rank_map(lambda r: t[r * k : (r + 1) * k].clone())

    def replicate(self, module: torch.nn.Module) -> torch.nn.Module:
        """Give every rank its own copy of `module`'s parameters and buffers (in place).

        A network built outside the world holds plain tensors; training it with per-rank data
        needs per-rank parameters (they stay equal when the training is data parallel).
        Build optimizers after this call (one built before holds the originals: its step is a
        ValueError, as it would train nothing). Replicas are plain parameters carrying the
        ``parallel_optimizer`` and ``comm_fusion`` attributes of the originals (as attributes).
        A parameter or buffer shared by several modules (a head tied to the embedding) gets one
        replica, shared the same way. A network built under ``sw.no_init_parameters()`` (meta
        parameters) is a ValueError: AutoParallel makes its blocks on each rank itself.
        """
        deferred = [n for n, p in module.named_parameters() if p.is_meta]
        if deferred:  # (a replica of a meta tensor fails later, in torch, naming neither)
            raise ValueError(
                f"replicate: {deferred[0]} (and {len(deferred) - 1} more) is not made yet (built "
                "under sw.no_init_parameters()): AutoParallel makes each rank's block of it "
                "itself, so wrap the network without replicate(); replicate only a network "
                "with its values"
            )
        # id of an original -> (the original, kept alive so its id stays unique; its replica)
        replicas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for prefix, mod in module.named_modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                if id(p) not in replicas:
                    replicas[id(p)] = (p, parameter_replica(p, self.same))
                    self._replaced.add(p, f"{prefix}.{name}" if prefix else name)
                setattr(mod, name, replicas[id(p)][1])
            for name, b in list(mod.named_buffers(recurse=False)):
                if b is not None:
                    if id(b) not in replicas:
                        replicas[id(b)] = (b, self.same(b))
                    setattr(mod, name, replicas[id(b)][1])  # keeps the buffer's persistence
        return module

    def local(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s value of `t`."""
        return self.local_tensors(t)[rank]

    def local_tensors(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's value of `t` (a plain tensor is the same on all ranks)."""
        if isinstance(t, self._local_tensor):
            return [t._local_tensors[r] for r in range(self.world_size)]
        return [t] * self.world_size

    def from_local_tensors(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """One tensor with value ``parts[r]`` on rank r."""
        return self.rank_map(lambda r: parts[r])

    def values(self, value: Any) -> list[Any]:
        """`value` on each rank: per-rank symbolic ints resolve, anything else repeats."""
        if isinstance(value, torch.SymInt):
            node = value.node
            if isinstance(node, self._int_node):
                return [node._local_ints[r] for r in range(self.world_size)]
            constant = node.maybe_as_int()
            if constant is not None:
                return [constant] * self.world_size
        return [value] * self.world_size

    def per_rank_int(self, values: Sequence[int]) -> int:
        """A symbolic int equal to ``values[r]`` on rank r."""
        node = self._int_node(local_ints=dict(enumerate(values)))
        return torch.SymInt(node)  # type: ignore[return-value,no-any-return]

    # -- groups ----------------------------------------------------------------------------
    def tiles(self, ranks: Sequence[int]) -> list[list[int]]:
        found = tiles(ranks, self.world_size)
        assert found is not None, "groups are checked when they are created"
        return found

    def rank_in(self, ranks: Sequence[int]) -> int:
        """Each rank's index in `ranks` (``get_rank()``): a per-rank int that a Python branch
        cannot take (`_rank_int`)."""
        index = {r: i for tile in self.tiles(ranks) for i, r in enumerate(tile)}
        node = rank_node({r: index[r] for r in range(self.world_size)}, self._int_node)
        return torch.SymInt(node)  # type: ignore[return-value,no-any-return]

    def new_group(self, name: str, ranks: Sequence[int]) -> dist.ProcessGroup:
        """The process group of the copy of `ranks` holding rank 0: this process is rank 0 of
        the fake job, and torch skips a collective on a group without it (a group named by a
        later copy, as [2, 3] of 4, then left every value as it was); LocalTensorMode runs the
        collective on every copy of the group it is given."""
        check_tiles(name, ranks, self.world_size)
        pg: dist.ProcessGroup = dist.new_group(self.tiles(ranks)[0])
        return pg

    def copy_of(self, rank: int, ranks: Sequence[int]) -> list[int]:
        """The copy of the group `ranks` (one of its `tiles`) that `rank` belongs to."""
        return next(tile for tile in self.tiles(ranks) if rank in tile)

    # -- point-to-point --------------------------------------------------------------------
    def exchange(
        self,
        kind: str,
        sends: Sequence[torch.Tensor],
        send_to: Sequence[tuple[int, int]],
        recv_from: Sequence[tuple[int, int]],
        recv_shapes: Sequence[Sequence[int]],
        dtype: torch.dtype,
        group: Sequence[int],
    ) -> tuple[list[torch.Tensor], int]:
        n = self.world_size
        parts = [self.local_tensors(s) for s in sends]
        queues: dict[tuple[int, int, int], deque[torch.Tensor]] = defaultdict(deque)
        sent = [0] * n
        for i, (peer, tag) in enumerate(send_to):
            for r, dst in enumerate(self.values(peer)):
                x = parts[i][r]
                if dst == -1 or x.numel() == 0:
                    continue
                self._check_peer(kind, dst, r, group)
                queues[(r, dst, tag)].append(x.detach().clone())
                sent[r] += x.numel() * x.element_size()
        outs = [
            self._receive(kind, j, peer, tag, recv_shapes[j], dtype, group, queues)
            for j, (peer, tag) in enumerate(recv_from)
        ]
        left = [(k, len(q)) for k, q in queues.items() if q]
        if left:
            (src, dst, tag), _ = left[0]
            raise ValueError(
                f"{kind}: rank {src} sends a tensor (tag {tag}) to rank {dst}, which does not "
                "receive it; check that recv_rank_ids mirror send_rank_ids"
            )
        return outs, max(sent)

    def _check_peer(self, kind: str, peer: int, rank: int, group: Sequence[int]) -> None:
        own = self.copy_of(rank, group)
        if peer not in own:
            raise ValueError(
                f"{kind}: rank {rank} names peer {peer}, not a rank of its group {own} (the "
                f"copy of group {list(group)} that rank {rank} runs)"
            )

    def _receive(
        self,
        kind: str,
        slot: int,
        peer: int,
        tag: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        group: Sequence[int],
        queues: dict[tuple[int, int, int], deque[torch.Tensor]],
    ) -> torch.Tensor:
        got = []
        for r, src in enumerate(self.values(peer)):
            want = tuple(int(d) for d in self.values_shape(shape, r))
            if src == -1 or 0 in want:
                got.append(torch.zeros(want, dtype=dtype))
                continue
            self._check_peer(kind, src, r, group)
            q = queues.get((src, r, tag))
            if not q:
                raise ValueError(
                    f"{kind}: rank {r} expects a tensor of shape {list(want)} from rank {src} "
                    f"(receive slot {slot}), but rank {src} sends nothing to rank {r}; "
                    "a real job would hang here"
                )
            x = q.popleft()
            if tuple(x.shape) != want:
                raise ValueError(
                    f"{kind}: rank {r} expects shape {list(want)} from rank {src} (receive slot "
                    f"{slot}) but rank {src} sends shape {list(x.shape)}; make recv_shapes match "
                    "the sender's send_shapes"
                )
            if x.dtype != dtype:  # (a job checks the message's header alike: `_exchange`)
                raise ValueError(
                    f"{kind}: rank {r} expects shape {list(want)} of {dtype} from rank {src}, "
                    f"which sent shape {list(x.shape)} of {x.dtype}: make recv_shapes and "
                    "recv_type match the sender's send_shapes and dtype"
                )
            got.append(x)
        return self.from_local_tensors(got)

    def values_shape(self, shape: Sequence[int], rank: int) -> list[int]:
        return [self.values(d)[rank] for d in shape]


def current_world() -> SimulatedWorld | None:
    """The active `SimulatedWorld`, or None outside `simulated_world`."""
    sim = _sim.current()
    return sim if isinstance(sim, SimulatedWorld) else None


@contextmanager
def simulated_world(world_size: int) -> Iterator[SimulatedWorld]:
    """Run every rank of a `world_size`-rank job in this process.

    Inside, tensors may hold a different value per rank (`SimulatedWorld.rank_map`),
    `shardwise.communication` functions and the collective primitives compute exactly what a
    real job would, and `get_rank()` is a per-rank int (so ``x[rank * k:(rank + 1) * k]`` works).
    A tensor made outside the world is one plain tensor all ranks share: an in-place op that
    writes per-rank values into it (``total += loss``) raises a ValueError (it would be updated
    once per rank); make it inside, pass it through `SimulatedWorld.same`, or write out of
    place. Build a network outside and pass it to `SimulatedWorld.replicate`: one built inside
    keeps what its constructor made with ``torch.tensor(...)`` (BatchNorm's
    ``num_batches_tracked``) as such a shared tensor, and ``checkpoint.load_distributed``
    into it raises that ValueError. A random op given an
    explicit ``generator=`` gives every rank the draw one process makes from it (as processes
    seeded alike do).

    Args:
        world_size: number of simulated ranks (>= 1).

    Yields:
        The `SimulatedWorld`.

    Raises:
        RuntimeError: a process group already exists in this process.

    Example:
        >>> with simulated_world(4) as world:
        ...     x = world.rank_map(lambda r: torch.full((2,), float(r)))
        ...     y = sw.ops.AllReduce()(x)          # 6.0 on every rank
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"simulated_world: world_size={world_size!r} must be an int >= 1")
    if dist.is_initialized():
        raise RuntimeError(
            "simulated_world: a process group already exists in this process; "
            "call shardwise.communication.release() first"
        )
    fake_pg, (_, local_tensor), local_tensor_mode = _private()
    hook = sys.excepthook  # (torch wraps it to prefix "[rank0]: " at each init: put it back)
    dist.init_process_group("fake", rank=0, world_size=world_size, store=fake_pg.FakeStore())
    mode = guarded_mode(local_tensor_mode, local_tensor)(world_size)
    world = SimulatedWorld(world_size, mode)
    previous = _sim.install(world)
    try:
        with mode:
            yield world
    finally:
        _sim.install(previous)
        world._replaced.close()
        _init.forget_groups()
        dist.destroy_process_group()
        sys.excepthook = hook
