"""What the simulated world adds to torch's LocalTensorMode so that one process behaves as n.

- A tensor made outside the world (before ``with simulated_world(n)``, or loaded from a file
  there) is one plain tensor that every rank shares. An in-place op that writes per-rank values
  into it (``total += loss`` with a running total made outside, an optimizer state tensor
  loaded whole) would run once per rank on that one tensor: n updates where a real job makes
  one per process. `check_write` raises a ValueError naming the op and the fix instead.
- A random op given an explicit ``generator=`` would draw each rank's numbers one after the
  other from that one generator (rank 1 the numbers after rank 0's), where each process of a
  real job draws from its own generator seeded alike. `same_draws` gives every rank the draw
  from the generator's state before the op, which then stands advanced once.

- A random op on tensors made inside the world but not per rank (``torch._standard_gamma(
  torch.tensor([0.4]))``, a ``Beta`` sample) drew once from the process's generator, leaving
  each rank's stream where it was (the next draw repeated numbers one process had used);
  `each_rank_draws` runs it for every rank from that rank's stream.
- An op on plain tensors given the rank (``torch.tensor(0.) + get_rank()``: a per-rank int)
  ran once with a placeholder in the rank's place (7777777 on every rank); `each_rank_int` runs
  it for every rank with that rank's value.
- Seeding inside the world (``torch.manual_seed`` in a train step) runs LocalTensorMode's own
  version, which copies the generator states with tensor ops; `quiet_seeding` runs it with
  torch-function modes off, so a wrapped step's plan executor does not see those copies as ops
  of the step (it stopped, naming ``torch.Tensor.clone``).
- A tensor whose value differs between the ranks turned into one Python value (``.item()``,
  ``bool()`` for an ``if``, ``float()``) failed inside torch with an AssertionError ("Non Tensor
  or int rank results must be equal") or an AttributeError (``guard_int``); `one_scalar`
  raises a ValueError naming the ranks' values and the fixes (an integer's ``.item()`` stays
  torch's per-rank int).

`guarded_mode` makes the LocalTensorMode subclass that does all of this.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from shardwise._torch import pytree

_SEEDING = ("torch.manual_seed", "torch.random.manual_seed")

_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}
# ops whose schema does not mark the arguments they write: (those arguments, the flag argument
# that says they are written, or None: always) (batch norm's running statistics)
_UNMARKED: dict[str, tuple[tuple[int, ...], int | None]] = {
    "aten::native_batch_norm": ((3, 4), 5),  # (when training)
    "aten::batch_norm_update_stats": ((1, 2), None),
}
_SEEDED: dict[Any, bool] = {}


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """The (position, name) of every argument aten overload `func` writes into (``add_``'s
    first, ``copy_``'s, ``_foreach_add_``'s list, batch norm's running statistics), cached per
    overload."""
    known = _WRITTEN.get(func)
    if known is None:
        known = ()
        if func.namespace == "aten":
            arguments = func._schema.arguments
            known = tuple(
                (i, a.name)
                for i, a in enumerate(arguments)
                if (a.alias_info is not None and a.alias_info.is_write)
                or (func._schema.name in _UNMARKED and i in _UNMARKED[func._schema.name][0])
            )
        _WRITTEN[func] = known
    return known


def _plain(x: Any, local: type) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, local)


def _per_rank(v: Any, local: type) -> bool:
    """A LocalTensor, or an int with each rank's value (``get_rank()``: a SymInt whose node
    holds per-rank ints)."""
    if isinstance(v, local):
        return True
    return isinstance(v, torch.SymInt) and getattr(v.node, "_local_ints", None) is not None


def _has_local(values: Any, local: type) -> bool:
    for v in values:
        if _per_rank(v, local):
            return True
        if isinstance(v, (list, tuple)) and any(_per_rank(u, local) for u in v):
            return True
    return False


def _rank_int_only(args: tuple[Any, ...], kwargs: dict[str, Any], local: type) -> bool:
    """Whether the per-rank values among the arguments are per-rank ints only, beside plain
    tensors (``torch.tensor(0.) + rank``, ``torch.cat([a, b], rank)``): LocalTensorMode would
    run such an op once, on a placeholder in place of the rank."""
    top = (*args, *kwargs.values())  # (most ops: a LocalTensor argument, or no int at all)
    if any(isinstance(v, local) for v in top):
        return False
    if not any(isinstance(v, torch.SymInt | list | tuple) for v in top):
        return False
    leaves = pytree.tree_leaves((args, kwargs))
    if any(isinstance(v, local) for v in leaves):
        return False
    return any(isinstance(v, torch.Tensor) for v in leaves) and _has_local(leaves, local)


def each_rank_int(mode: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`func` run for every rank of `mode` with each per-rank int replaced by that rank's value
    (torch's own per-rank runner: results joined into per-rank tensors, each rank's random
    stream)."""
    streams = importlib.import_module("torch.distributed._local_tensor")
    return streams._for_each_rank_run_func(func, mode.ranks, args, kwargs, alias=True)


def check_write(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], local: type) -> None:
    """Raise ValueError when `func` writes per-rank values (a LocalTensor among its other
    arguments) into a plain tensor that all ranks share (an argument it writes: ``add_``'s
    first, batch norm's running statistics)."""
    unmarked = _UNMARKED.get(func._schema.name) if func.namespace == "aten" else None
    flag = None if unmarked is None else unmarked[1]
    if flag is not None and not (len(args) > flag and args[flag]):
        return  # (not written this time: batch norm in eval)
    for i, name in _written(func):
        given = args[i] if i < len(args) else kwargs.get(name)
        targets = given if isinstance(given, (list, tuple)) else (given,)
        if any(_plain(t, local) for t in targets):
            others = [a for j, a in enumerate(args) if j != i]
            others += [v for k, v in kwargs.items() if k != name]
            if _has_local(others, local):
                _refuse(func, next(t for t in targets if _plain(t, local)))


def _refuse(func: Any, target: torch.Tensor) -> None:
    """The ValueError of `check_write`: `func` writes each rank's value into `target`."""
    shape = list(target.shape)
    if isinstance(target, torch.nn.Parameter):
        raise ValueError(
            f"simulated world: {func} writes each rank's value into a parameter of shape "
            f"{shape} that every rank shares (a network built outside the world holds plain "
            "tensors): it would be updated once per simulated rank. Call world.replicate(net) "
            "inside the world before the network runs (and build its optimizers after it), "
            "which gives every rank its own parameters and buffers"
        )
    raise ValueError(
        f"simulated world: {func} writes each rank's value into a tensor of shape {shape} "
        "that every rank shares (one plain tensor: made outside the world, or by "
        "torch.tensor(...) inside it): it would be updated once per simulated rank, where a "
        "real job updates it once per process. A network's buffer (built outside the world): "
        "call world.replicate(net) inside the world before it runs; another tensor: make it "
        "inside the world with a factory (torch.zeros, or world.same(...)), or write out of "
        "place (total = total + loss)"
    )


_SCALAR_OPS = frozenset({"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item"})
_SCALAR: dict[Any, bool] = {}


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.equal(a, b):
        return True
    if not a.is_floating_point() or not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _counts(dtype: torch.dtype) -> bool:
    """Integer dtypes, whose ``.item()`` torch makes a per-rank int (a size, a count)."""
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def one_scalar(func: Any, args: tuple[Any, ...], local: type) -> tuple[bool, Any]:
    """(True, the value) when `func` turns a per-rank tensor into one Python value (``.item()``,
    ``bool()``, ``float()``) and every rank holds the same value (NaN included, which torch's
    comparison of the ranks' numbers refused); (False, None) for other ops, and for ``.item()``
    of an integer tensor (torch's per-rank int, each rank's value: ``torch.full((n,),
    counts.item())``). Raise ValueError when the ranks' values differ otherwise (a float, or a
    bool for a branch)."""
    scalar = _SCALAR.get(func)
    if scalar is None:
        scalar = _SCALAR[func] = func.name() in _SCALAR_OPS
    if not scalar or not args or not isinstance(args[0], local):
        return False, None
    parts = args[0]._local_tensors  # type: ignore[attr-defined]
    ranks = sorted(parts)
    if all(_same_values(parts[r], parts[ranks[0]]) for r in ranks[1:]):
        return True, func(parts[ranks[0]], *args[1:])
    first = parts[ranks[0]]
    if func.name() == "aten::_local_scalar_dense" and _counts(first.dtype):
        return False, None  # (torch's per-rank int: each rank's count, as in a real job)
    shown = ", ".join(f"rank {r}: {parts[r].item()!r}" for r in ranks[:4])
    raise ValueError(
        f"simulated world: a tensor whose value differs between the ranks ({shown}) was "
        "turned into one Python value (.item(), float(), bool() or an `if` on a tensor): one "
        "process runs every rank, so one Python value cannot hold each rank's, and an `if` "
        "cannot take each rank's way. Reduce it first so that every rank holds the same value "
        "(sw.ops.AllReduce, or the loss a wrapped step returns), compute with tensors "
        "(torch.where), or test such code in a real job (shardwise.testing.run_job)"
    )


def same_draws(
    mode: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], local: type
) -> Any:
    """`func` (given an explicit ``generator``) run for every rank of `mode` from the
    generator's state before the call: a new tensor (a factory), or each rank's part of its
    first argument filled in place (``normal_``); None when other arguments hold per-rank
    values (left to LocalTensorMode)."""
    gen = kwargs["generator"]
    first = args[0] if args and isinstance(args[0], local) else None
    rest = args[1:] if first is not None else args
    if _has_local(rest, local) or _has_local(kwargs.values(), local):
        return None
    start = gen.get_state()

    def draw(r: int) -> torch.Tensor:
        gen.set_state(start)
        if first is None:
            out: torch.Tensor = func(*args, **kwargs)
            return out
        filled: torch.Tensor = func(first._local_tensors[r], *rest, **kwargs)  # type: ignore[attr-defined]
        return filled

    made = mode.rank_map(draw)
    return made if first is None else first


def _plain_draw(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], local: type) -> bool:
    """Whether `func` draws random numbers into a new tensor from plain tensor arguments only
    (none per rank)."""
    seeded = _SEEDED.get(func)
    if seeded is None:
        seeded = _SEEDED[func] = torch.Tag.nondeterministic_seeded in func.tags
    if not seeded or any(i == 0 for i, _ in _written(func)):  # (an in-place draw)
        return False
    values = [*args, *kwargs.values()]
    return any(_plain(v, local) for v in values) and not _has_local(values, local)


def each_rank_draws(mode: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`func` run for every rank of `mode` from that rank's random stream, which it advances
    (as LocalTensorMode runs a draw on per-rank tensors)."""
    streams = importlib.import_module("torch.distributed._local_tensor")
    states = mode._per_rank_rng_states

    def draw(r: int) -> torch.Tensor:
        streams._set_rng_state(*states[r])
        out: torch.Tensor = func(*args, **kwargs)
        states[r] = streams._get_rng_state()
        return out

    return mode.rank_map(draw)


def quiet_seeding() -> None:
    """Wrap the seeding functions LocalTensorMode put in place (`_SEEDING`) so that they run
    with torch-function modes off (called after it patched them)."""
    for name in _SEEDING:
        module_name, attr = name.rsplit(".", 1)
        module = importlib.import_module(module_name)
        seeding = getattr(module, attr)
        if not getattr(seeding, "quiet", False):
            setattr(module, attr, _quiet(seeding))


def _quiet(seeding: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(seeding)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return seeding(*args, **kwargs)

    quiet.quiet = True  # type: ignore[attr-defined]
    return quiet


def guarded_mode(mode_cls: type, local: type) -> type:
    """A subclass of torch's LocalTensorMode `mode_cls` whose dispatch runs `check_write`,
    `one_scalar`, `same_draws` and `each_rank_draws`, and whose seeding is quiet
    (`quiet_seeding`)."""

    class GuardedLocalTensorMode(mode_cls):  # type: ignore[misc, valid-type]
        def _patch_random_functions(self) -> None:
            super()._patch_random_functions()
            quiet_seeding()

        def __torch_dispatch__(
            self,
            func: Any,
            types: tuple[Any, ...],
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            if not self._disable:
                check_write(func, args, kwargs or {}, local)
                scalar, value = one_scalar(func, args, local)
                if scalar:
                    return value
                if kwargs and kwargs.get("generator") is not None:
                    made = same_draws(self, func, args, kwargs, local)
                    if made is not None:
                        return made
                elif self._per_rank_rng_states and _plain_draw(func, args, kwargs or {}, local):
                    return each_rank_draws(self, func, args, kwargs or {})
                if _rank_int_only(args, kwargs or {}, local):
                    return each_rank_int(self, func, args, kwargs or {})
            return super().__torch_dispatch__(func, types, args, kwargs)

    return GuardedLocalTensorMode
