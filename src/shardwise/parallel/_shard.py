"""`sw.shard` and `sw.reshard`: layouts set by the user on tensors, functions and parameters.

- `reshard(tensor, layout)`: inside a network run by `AutoParallel`, moves the tensor to
  `layout` (a redistribution: slices, AllGather, AlltoAll) and records it there; elsewhere (one
  device, or outside a wrapped call) it returns the tensor unchanged.
- `shard(fn_or_module, in_strategy, out_strategy, parameter_plan)`: reshards a function's (or
  module's) tensor inputs to `in_strategy` and its outputs to `out_strategy` (for an
  ``nn.Linear`` / ``nn.Embedding`` with one entry per tensor of its op, the op form: the strategy
  of that op, `op_strategy`, which the capture attaches to its node); the body runs with
  the usual semi_auto rules (primitives as their strategies say, unannotated torch ops data
  parallel). `parameter_plan` sets the layout in which parameters are *stored* on the ranks:
  each primitive gets its parameters redistributed from there to the layout its strategy wants
  (with the adjoint in backward), and unannotated torch ops get them whole (AllGather). Which tensor
  each entry is for, and the resharding itself: `_shard_io`.
- `Session`: what an `AutoParallel` offers during one wrapped call (`active_session`); the
  wrapper registers itself with `activate`. A network run from its captured graph reshards
  through `reshard_value`, one op of the graph.
- `to_layout`: a strategy entry (int tuple or Layout call) for one tensor as a `TensorLayout`.
- `Declared`: the layouts declared while planning, and the parameter plan by full name.

While the wrapper traces the network on meta tensors (planning), `reshard` and the `shard`
wrappers only declare their layouts (`Session.reshard` records each layout's device matrix,
`Session.declare_parameters` the parameter plan, both into the wrapper's `Declared`) so that
the plan's global device matrix refines them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function_unary

from shardwise import communication as comm
from shardwise.layout import LayoutTypeError, TensorLayout
from shardwise.ops import Primitive, normalize_entry, normalize_strategy
from shardwise.parallel._shard_io import reshard_inputs, reshard_outputs
from shardwise.parallel._shard_labels import ShardLabels
from shardwise.planner._annotated import entry_layout
from shardwise.planner._graph import OP_STRATEGY

Entry = tuple[int, ...] | TensorLayout
Shape = tuple[int, ...]


class Session(Protocol):
    """What `reshard` and `shard` need from the running `AutoParallel`."""

    def reshard(
        self, t: torch.Tensor, entry: Entry, who: str = "sw.reshard", what: str = ""
    ) -> torch.Tensor:
        """Move `t` to the layout `entry` names (at run time) or declare it (while
        planning); `who` and `what` name it in messages (`reshard_value`)."""
        ...

    def declare_parameters(self, owner: nn.Module | None, plan: Mapping[str, Entry]) -> None:
        """Record a parameter plan (names relative to `owner`; None: to the network)."""
        ...


_active: list[Session] = []


def active_session() -> Session | None:
    """The `AutoParallel` running the current call, or None."""
    return _active[-1] if _active else None


@contextmanager
def activate(session: Session) -> Iterator[None]:
    """Make `session` the target of `reshard` / `shard` while the block runs."""
    _active.append(session)
    try:
        yield
    finally:
        _active.pop()


def to_layout(entry: object, shape: Sequence[int], who: str) -> TensorLayout:
    """One tensor's strategy entry (split counts, repeat appended on the right; or a Layout
    call) as a `TensorLayout` for a tensor of global `shape`, checked against it
    (`planner._annotated.entry_layout` with this job's size).

    Raises:
        ValueError / LayoutTypeError: a malformed entry, or one that does not fit.
    """
    return entry_layout(entry, tuple(int(s) for s in shape), comm.get_group_size(), who)


class Declared:
    """What `reshard` and the `shard` wrappers declared while the network was traced."""

    def __init__(self) -> None:
        self.matrices: list[tuple[int, ...]] = []  # device matrices of `reshard` layouts
        self.entries: dict[str, Entry] = {}  # full parameter name -> its parameter_plan entry

    def add(self, network: nn.Module, owner: nn.Module | None, plan: Mapping[str, Entry]) -> None:
        """Record `plan` (names relative to `owner`, a module inside `network`; None: the
        network itself).

        Raises:
            ValueError: `owner` is not inside `network`, or a name is not a parameter.
        """
        prefix = ""
        if owner is not None and owner is not network:
            found = [n for n, m in network.named_modules() if m is owner]
            if not found:
                raise ValueError(
                    f"sw.shard: a module with a parameter_plan ({type(owner).__name__}) is not "
                    f"part of the network AutoParallel wraps"
                )
            prefix = found[0] + "."
        names = _stored_names(network)
        for name, entry in plan.items():
            full = prefix + name
            if full not in names:
                valid = sorted(n[len(prefix) :] for n in names if n.startswith(prefix))
                raise ValueError(
                    f"sw.shard: parameter_plan names {name!r}, which is not a parameter of "
                    f"{type(owner or network).__name__}; valid names: {valid}"
                )
            stored = names[full]  # (a tied name: the one parameter, by its first name)
            if self.entries.get(stored, entry) != entry:
                raise ValueError(
                    f"sw.shard: parameter_plan gives {full!r} {entry!r}, but it is tied to "
                    f"{stored!r} (one parameter), which has {self.entries[stored]!r}; give the "
                    "one parameter one layout"
                )
            self.entries[stored] = entry

    def parameter_layouts(self, network: nn.Module) -> dict[str, tuple[TensorLayout, Shape]]:
        """Every declared parameter's layout and global shape (checked against it)."""
        out = {}
        for name, entry in self.entries.items():
            shape = tuple(int(s) for s in network.get_parameter(name).shape)
            out[name] = (to_layout(entry, shape, f"sw.shard: parameter_plan[{name!r}]"), shape)
        return out


def _stored_names(network: nn.Module) -> dict[str, str]:
    """Every name of `network`'s parameters -> the name the plan stores it by: a tied weight's
    second name (``head.weight = emb.weight``) -> its first (``emb.weight``)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in network.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _bias_dropped(module: nn.Module, ins: Sequence[Entry] | None, who: str) -> Any:
    """`in_strategy` without the bias entry of an ``nn.Linear``'s op form given with one (as
    ``strategies()`` prints the op: input, weight, bias), once it is checked to split the bias
    as the weight's rows (the output features), which is how the op form splits it."""
    if not isinstance(module, nn.Linear) or module.bias is None or ins is None or len(ins) != 3:
        return ins
    if type(module).forward is not nn.Linear.forward:  # (its own forward: 3 inputs, maybe)
        return ins
    weight, bias = ins[1], ins[2]
    if isinstance(weight, TensorLayout) and isinstance(bias, TensorLayout):
        rows = weight.groups[0] if weight.groups else 1
        alike = bias.dims == weight.dims[:1] and (bias.groups[0] if bias.groups else 1) == rows
    elif isinstance(weight, TensorLayout) or isinstance(bias, TensorLayout):
        alike = False  # (mixed kinds: `shard` refused them before)
    else:
        alike = tuple(bias) == tuple(weight)[:1]
    if not alike:
        raise ValueError(
            f"{who}: the op form of {type(module).__name__} with a bias entry: the bias "
            f"{_fmt(bias)} must be split as the weight's rows (the output features), "
            f"{_fmt(weight)}; give ({_fmt(ins[0])}, {_fmt(weight)}) and the bias follows"
        )
    return tuple(ins[:2])


def _is_op_form(module: nn.Module, ins: Sequence[Entry] | None) -> bool:
    """Whether `in_strategy` annotates `module`'s op (``nn.Linear``: the input and the weight,
    as ``MatMul(transpose_b=True)`` takes them) rather than its inputs."""
    names = op_form_names(module)
    return names is not None and ins is not None and len(ins) == len(names)


def op_form_names(module: nn.Module) -> tuple[str, ...] | None:
    """The tensor arguments of the op `shard`'s op form annotates on `module` (its class or
    nearest base class in `OP_FORM`: a subclass of ``nn.Linear`` too), or None."""
    return next((OP_FORM[c] for c in type(module).__mro__ if c in OP_FORM), None)


def _fmt(entry: Entry) -> str:
    return str(entry) if isinstance(entry, TensorLayout) else str(tuple(entry))


def reshard(tensor: torch.Tensor, layout: object) -> torch.Tensor:
    """Pin `tensor`'s layout at this point of a network.

    Args:
        tensor: an activation inside a network run by `AutoParallel`.
        layout: a Layout call such as ``layout("dp", "None")`` or split counts ``(2, 1)``
            (the repeat factor appended on the right).

    Returns:
        Under `AutoParallel`: this rank's block of the tensor in `layout` (redistributed with
        slices / AllGather / AlltoAll, exact backward). Elsewhere: `tensor` unchanged.

    Raises:
        ValueError: the layout does not fit the tensor or the job (at plan time).

    Example:
        >>> h = sw.reshard(h, layout("dp", "None"))
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"sw.reshard: expected a tensor, got {type(tensor).__name__}")
    checked = normalize_entry(layout, "layout", "sw.reshard")
    session = active_session()
    if session is None:
        return tensor
    return session.reshard(tensor, checked)


def reshard_value(
    tensor: torch.Tensor, entry: Entry, who: str = "sw.reshard", what: str = ""
) -> torch.Tensor:
    """The graph op of `reshard` (``"shardwise.reshard"``): seen as one call by the capture
    and by the plan executor (torch-function modes), which place its output in `entry`'s
    layout; on its own it returns a view of `tensor` (a new value: later uses of `tensor`
    itself keep its layout). `who` and `what` (kept as arguments of its node) name it in the
    plan's messages: ``sw.reshard``, or the ``sw.shard`` call and its strategy entry
    (`_shard_labels`)."""
    if has_torch_function_unary(tensor):
        out: torch.Tensor = handle_torch_function(
            reshard_value, (tensor,), tensor, entry, who, what
        )
        return out
    return tensor.view_as(tensor)  # (a new value: the input keeps its own layout)


reshard_value.__qualname__ = "shardwise.reshard"


# Modules whose single torch call `shard`'s op form annotates: its tensor arguments, in order.
OP_FORM: dict[type[nn.Module], tuple[str, ...]] = {
    nn.Linear: ("input", "weight"),
    nn.Embedding: ("input", "weight"),
}


def _check_plan(parameter_plan: object, who: str) -> dict[str, Entry]:
    if parameter_plan is None:
        return {}
    if not isinstance(parameter_plan, Mapping):
        raise TypeError(
            f"{who}: parameter_plan must be a dict name -> layout, not {parameter_plan!r}"
        )
    out: dict[str, Entry] = {}
    for name, entry in parameter_plan.items():
        if not isinstance(name, str):
            raise TypeError(f"{who}: parameter_plan key {name!r} is not a parameter name")
        out[name] = normalize_entry(entry, f"parameter_plan[{name!r}]", who)
    return out


def shard(
    fn_or_module: Callable[..., Any] | nn.Module,
    in_strategy: object,
    out_strategy: object = None,
    parameter_plan: object = None,
) -> Any:
    """Set the layouts of a function's or module's inputs, outputs and parameters.

    Args:
        fn_or_module: a function of tensors, or an `nn.Module` (changed in place: hooks).
        in_strategy: one entry per tensor input: split counts such as ``(2, 1)`` or a Layout
            call; None leaves the inputs as they come. The positional tensors first, then
            those passed by keyword in the order the signature lists them (``**kwargs``: in
            the order passed); or one per positional tensor only, the keyword ones then left
            as they come.
        out_strategy: one entry per tensor output, or None (outputs as the body leaves them).
        parameter_plan: parameter name -> entry: the layout each listed parameter is stored in
            (names relative to the module; for a function, to the network `AutoParallel`
            wraps), e.g. ``{"fc.weight": (1, 4)}``.

    A shardwise primitive (``sw.ops.MatMul()``) takes the strategies as its own
    ``primitive.shard(in_strategy, out_strategy)`` does.

    The op form: for an ``nn.Linear`` or ``nn.Embedding``, an `in_strategy` with one entry per
    tensor of the module's op, ``(input, weight)``, annotates that op instead of resharding the
    module's inputs, the way a primitive's ``shard()`` does: ``nn.Linear`` as
    ``MatMul(transpose_b=True)`` takes it (the input as ``(rows, in_features)``, rows being
    dim 0; the weight ``[out_features, in_features]``; the bias follows the output features),
    ``nn.Embedding`` as ``F.embedding(ids, weight)`` (the weight split on the embedding dim).
    ``sw.shard(block.attn.c_attn, in_strategy=((2, 1), (4, 1)))`` makes the Linear column
    parallel (input rows over a 2-way axis, output features over a 4-way one);
    ``((2, 4), (1, 4))`` makes it row parallel (a partial output, all-reduced where it is
    consumed). The weight is stored in that layout.

    Returns:
        The module itself, or a function with `fn`'s signature. Without `AutoParallel` (one
        device) it computes exactly what `fn_or_module` computes.

    Raises:
        TypeError / ValueError: malformed strategies (at once); strategies that do not fit the
            tensors or the job, unknown parameter names (at plan time).

    Example:
        >>> mlp = sw.shard(mlp, in_strategy=((2, 1),), parameter_plan={"fc1.weight": (4, 1)})
    """
    who = "sw.shard"
    if isinstance(fn_or_module, Primitive):  # (its own strategy: as primitive.shard(...))
        if parameter_plan is not None:
            raise ValueError(
                f"{who}: {fn_or_module.who} is a primitive, which holds no parameters; its "
                f"in_strategy sets the layouts of its inputs (a weight among them): drop "
                f"parameter_plan"
            )
        return fn_or_module.shard(in_strategy, out_strategy)
    ins = normalize_strategy(in_strategy, "in_strategy", who) if in_strategy is not None else None
    outs = normalize_strategy(out_strategy, "out_strategy", who)
    params = _check_plan(parameter_plan, who)
    given = [*(ins or ()), *(outs or ()), *params.values()]
    if len({isinstance(e, TensorLayout) for e in given}) > 1:
        raise ValueError(
            f"{who}: in_strategy, out_strategy and parameter_plan mix int tuples and Layouts; "
            "use one kind for all of them (as a primitive's shard())"
        )
    if isinstance(fn_or_module, nn.Module):
        ins = _bias_dropped(fn_or_module, ins, who)
    if isinstance(fn_or_module, nn.Module) and _is_op_form(fn_or_module, ins):
        if outs is not None or params:
            names = ", ".join(op_form_names(fn_or_module) or ())
            raise ValueError(
                f"{who}: the op form of {type(fn_or_module).__name__} (one in_strategy entry per "
                f"tensor of its op: {names}) sets the weight's layout itself; give no "
                f"out_strategy or parameter_plan with it"
            )
        setattr(fn_or_module, OP_STRATEGY, ins)
        return fn_or_module
    labels = ShardLabels(fn_or_module)
    if isinstance(fn_or_module, nn.Module):
        module = fn_or_module

        def before(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            session = active_session()
            if session is not None and params:
                session.declare_parameters(m, params)
            new_args, new_kwargs = reshard_inputs(args, kwargs, ins, labels, session, module=True)
            return tuple(new_args), new_kwargs

        def after(m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
            return reshard_outputs(out, outs, labels, active_session())

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after)
        return module
    if not callable(fn_or_module):
        raise LayoutTypeError(f"{who}: expected a function or an nn.Module, got {fn_or_module!r}")
    fn = fn_or_module

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        session = active_session()
        if session is not None and params:
            session.declare_parameters(None, params)
        new_args, new_kwargs = reshard_inputs(args, kwargs, ins, labels, session)
        return reshard_outputs(fn(*new_args, **new_kwargs), outs, labels, session)

    return wrapper
