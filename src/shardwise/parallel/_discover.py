"""Which modules and optimizers a train-step function uses, read from what its code loads.

`AutoParallel(train_step)` and the data-parallel runner need the step's network and optimizers
without the user naming them. `find_referenced` reads the function's bytecode (`dis`) and
collects the values it really loads:

- `_loaded_values`: globals (``LOAD_GLOBAL`` / ``LOAD_NAME``), closure cells (``LOAD_DEREF``)
  and, for a bound method, ``self``; each followed through the attribute chain the code reads
  on it (``trainer.net``, ``self.model.encoder``: `_attribute`, which reads stored values only,
  never runs a property);
- functions reached that way (a helper the step calls, a nested function or lambda defined in
  it: `_nested_code`) are read the same way, once each (`_Search`); not those of torch or
  shardwise, nor the methods of a module or optimizer (``optimizer.step``);
- modules and optimizers bound to the function: a ``functools.partial``'s arguments
  (``partial(train_step, net, opt)``) and default arguments (``def step(x, net=net)``).

Attribute names alone (``optimizer.step()`` names ``step``) load nothing, so a global that
shares such a name is not picked up. shardwise's own wrappers (`is_wrapper`: `AutoParallel`
and the like, which contain the network) are skipped.

`hook_objects`: the same objects for the hooks the network's modules run (a forward hook's
closure list, a bound-method hook's object), not for torch's and shardwise's own hooks.

`pick_network`: of the modules found, the one with parameters that contains the others;
`grad_scalers`: the ``GradScaler`` objects the step loads; `agree_scalers`: one inf/NaN verdict
for all of them.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shardwise._torch.grad_scaler import agree_on_overflow
from shardwise._torch.module_state import hook_functions
from shardwise.communication import recorder
from shardwise.communication._collectives import ReduceOp, all_reduce

_ROOT_LOADS = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"}
_ATTR_LOADS = {"LOAD_ATTR", "LOAD_METHOD"}
_MAX_FUNCTIONS = 64
_LIBRARIES = {"torch", "shardwise", "numpy", "functools", "builtins"}
"""Packages whose functions are not followed (the user's network is not defined there)."""
_MISSING = object()


def is_wrapper(value: object) -> bool:
    """Whether `value` is one of shardwise's wrappers (a class attribute marks them)."""
    return bool(getattr(type(value), "_shardwise_wrapper", False))


def _attribute(obj: Any, name: str) -> Any:
    """`obj.name` as stored (a module's submodule / parameter, an instance or class value),
    without running properties or ``__getattr__`` hooks; `_MISSING` when not stored."""
    if isinstance(obj, nn.Module):
        for store in ("_modules", "_parameters", "_buffers"):
            found = obj.__dict__.get(store, {}).get(name, _MISSING)
            if found is not _MISSING:
                return found
    try:
        value = inspect.getattr_static(obj, name)
    except AttributeError:
        return _MISSING
    if isinstance(value, property | types.GetSetDescriptorType | types.MemberDescriptorType):
        return _MISSING
    if isinstance(value, staticmethod | classmethod):
        return value.__func__
    stored_on_object = isinstance(obj, type | types.ModuleType) or name in getattr(
        obj, "__dict__", {}
    )
    if isinstance(value, types.FunctionType) and not stored_on_object:
        return types.MethodType(value, obj)  # a method of the class read on an instance: bound
    return value


def _nested_code(code: types.CodeType) -> Iterator[types.CodeType]:
    """The code objects defined inside `code` (nested functions, lambdas, comprehensions)."""
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield const
            yield from _nested_code(const)


def _cells(fn: types.FunctionType) -> dict[str, Any]:
    """`fn`'s closure variables that hold a value, by name."""
    out = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return out


def _loaded_values(
    code: types.CodeType, scope: dict[str, Any], cells: dict[str, Any], this: Any
) -> Iterator[Any]:
    """Each value `code` loads from `scope` (globals), `cells` (closure) or `this` (a bound
    method's ``self``, the first argument), and each attribute it reads on such a value."""
    first = code.co_varnames[0] if code.co_argcount and this is not _MISSING else None
    current: Any = _MISSING
    for ins in dis.get_instructions(code):
        arg = ins.argval  # (3.13 pairs two local loads: the last one is on top)
        arg = arg[-1] if isinstance(arg, tuple) and "LOAD_FAST" in ins.opname else arg
        name = arg if isinstance(arg, str) else None
        if ins.opname in _ROOT_LOADS and name is not None:
            current = cells.get(name, scope.get(name, _MISSING))
        elif "LOAD_FAST" in ins.opname and name is not None and name == first:
            current = this
        elif ins.opname in _ATTR_LOADS and name is not None and current is not _MISSING:
            current = _attribute(current, name)
        else:
            current = _MISSING
            continue
        if current is not _MISSING:
            yield current


class _Search:
    """Walk the functions reachable from a train step, collecting the values they load."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.scopes: list[Any] = []  # (the functions' globals dicts and closure cells)
        self.seen: set[int] = set()

    def function(self, fn: Any, root: bool = False) -> None:
        """Collect what `fn` loads; follow the functions it reaches (not shardwise's own)."""
        fn = _as_function(fn)
        if isinstance(fn, functools.partial):  # (its bound arguments, then its function)
            self.bound([*fn.args, *fn.keywords.values()])
            self.function(fn.func, root)
            return
        this = getattr(fn, "__self__", _MISSING)
        fn = getattr(fn, "__func__", fn)
        if not isinstance(fn, types.FunctionType) or id(fn) in self.seen:
            return
        library = (fn.__module__ or "").split(".")[0] in _LIBRARIES
        owner = isinstance(this, nn.Module | torch.optim.Optimizer)
        if not root and (len(self.seen) >= _MAX_FUNCTIONS or library or owner):
            return
        self.seen.add(id(fn))
        scope, cells = fn.__globals__, _cells(fn)
        self.scopes += [scope, *(fn.__closure__ or ())]
        if this is not _MISSING:
            self.values.append(this)
        self.bound([*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()])
        for code in (fn.__code__, *_nested_code(fn.__code__)):
            bound = this if code is fn.__code__ else _MISSING
            for value in _loaded_values(code, scope, cells, bound):
                if is_wrapper(value):
                    continue
                self.values.append(value)
                if callable(value) and not isinstance(value, nn.Module | type):
                    self.function(value)

    def bound(self, values: list[Any]) -> None:
        """Values bound to a function (a partial's arguments, default arguments): objects with
        attributes (modules, optimizers, a ``GradScaler``, a trainer); not tensors, functions,
        classes or plain values (not followed: a default may be anything)."""
        plain = (torch.Tensor, types.FunctionType, types.MethodType, types.ModuleType, type)
        self.values += [v for v in values if hasattr(v, "__dict__") and not isinstance(v, plain)]


def _as_function(fn: Any) -> Any:
    """An object with a Python ``__call__`` (a train step written as a class, not a module):
    its bound ``__call__``; anything else as it is."""
    if isinstance(fn, types.FunctionType | types.MethodType | functools.partial | nn.Module):
        return fn
    found = (vars(c)["__call__"] for c in type(fn).__mro__ if "__call__" in vars(c))
    call = next(found, None) if callable(fn) else None  # (its own or a base class's)
    return fn.__call__ if isinstance(call, types.FunctionType) else fn


def _readable(fn: Any) -> bool:
    """Whether `fn` has Python code to read (a function, a bound method, an object with a
    Python ``__call__``, a partial of one)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = _as_function(fn)
    return isinstance(getattr(fn, "__func__", fn), types.FunctionType)


def find_referenced(fn: Callable[..., Any]) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """The modules and optimizers a train step uses, in the order its code loads them.

    Args:
        fn: the train step (a function, lambda, bound method or ``functools.partial`` of one:
            its bound arguments and default arguments count as loaded).

    Returns:
        ``(modules, optimizers)``: every `nn.Module` and `torch.optim.Optimizer` the code loads
        from its globals or closure, through attribute reads on them (``self.net``), in the
        helper functions it calls and the functions defined inside it; each once.

    Raises:
        TypeError: `fn` has no Python code to read (a builtin, a C function).

    Example:
        >>> def step(x):
        ...     loss = net(x).sum(); loss.backward(); optimizer.step(); return loss
        >>> find_referenced(step)   # ([net], [optimizer]), even with a global named ``step``
    """
    if not _readable(fn):
        raise TypeError(f"AutoParallel: cannot inspect {fn!r}; pass network= and optimizer=")
    search = _Search()
    search.function(fn, root=True)
    unique = list({id(v): v for v in search.values}.values())
    modules = [v for v in unique if isinstance(v, nn.Module)]
    optimizers = [v for v in unique if isinstance(v, torch.optim.Optimizer)]
    return modules, optimizers


def find_objects(fn: Callable[..., Any]) -> list[Any]:
    """The objects whose state a train step's code may change, each once: those with
    attributes it loads (as `find_referenced` reads them: a ``GradScaler``, a trainer, modules,
    optimizers, a ``random.Random``), NumPy's random generators, the dicts, lists and sets it
    loads (``stats["correct"] = ...``), and the globals dict and closure cells of each
    function it runs (``global total``, ``nonlocal total``); none for a callable without
    Python code."""
    if not _readable(fn):
        return []
    search = _Search()
    search.function(fn, root=True)
    plain = (types.FunctionType, types.MethodType, types.ModuleType, type)
    found = {
        id(v): v
        for v in [*search.values, *search.scopes]
        if isinstance(v, dict | list | set | types.CellType)
        or (hasattr(v, "__dict__") and not isinstance(v, plain))
        or hasattr(v, "bit_generator")  # (NumPy's Generator: state, no __dict__)
        or type(v).__name__ == "RandomState"
    }
    return list(found.values())


def noted_modules(network: nn.Module, loaded: Iterable[Any]) -> list[nn.Module]:
    """The modules whose own attributes a call notes (`planner._user_state.module_attributes`):
    the network's and those of the other modules among the objects the step loads (`loaded`,
    `find_objects`'s: a criterion with a counter), each once."""
    found = {id(m): m for m in network.modules()}
    for obj in loaded:
        if isinstance(obj, nn.Module):
            found.update((id(m), m) for m in obj.modules())
    return list(found.values())


def _library(fn: Any) -> bool:
    """Whether `fn` (a function, bound method, partial or callable object) is defined in one of
    `_LIBRARIES` (torch's and shardwise's own hooks)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    where = fn.__module__ if isinstance(fn, types.FunctionType) else type(fn).__module__
    return (where or "").split(".")[0] in _LIBRARIES


def hook_objects(modules: Iterable[nn.Module]) -> list[Any]:
    """What `find_objects` finds for each hook that `modules` run (forward and backward hooks
    and pre-hooks, their own and those registered for all modules) and that is not torch's or
    shardwise's: a hook's closure cells and globals, the object of a bound-method hook."""
    found: dict[int, Any] = {}
    for hook in hook_functions(modules):
        if not _library(hook):
            found |= {id(v): v for v in find_objects(hook)}
    return list(found.values())


_SCAN = 10_000  # values looked through for GradScalers kept in containers and objects


def grad_scalers(fn: Callable[..., Any]) -> list[torch.amp.GradScaler]:
    """The ``torch.amp.GradScaler`` objects a train step's code loads (`find_objects`), also
    those it reaches through a dict, list, tuple or set or an object's attributes
    (``amp["scaler"]``, ``cfg.amp.scaler``; up to `_SCAN` values looked through)."""
    found: list[torch.amp.GradScaler] = []
    todo, seen, looked = deque(find_objects(fn)), set(), 0
    skip = (nn.Module, torch.optim.Optimizer, torch.Tensor, types.ModuleType, type)
    while todo and looked < _SCAN:
        v = todo.popleft()
        looked += 1
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, torch.amp.GradScaler):
            found.append(v)
        elif isinstance(v, dict):
            todo.extend(() if "__builtins__" in v else v.values())  # (globals: loaded by name)
        elif isinstance(v, list | tuple | set | frozenset):
            todo.extend(v)
        elif isinstance(v, nn.Module):  # (a trainer module's self.scaler; not its submodules)
            todo.extend(x for k, x in vars(v).items() if not k.startswith("_"))
        elif isinstance(v, types.CellType):
            with contextlib.suppress(ValueError):  # (an empty cell)
                todo.append(v.cell_contents)
        elif not isinstance(v, skip) and isinstance(getattr(v, "__dict__", None), dict):
            todo.extend(vars(v).values())
    return found


def agree_scalers(fn: Callable[..., Any]) -> list[Callable[[], None]]:
    """Give every GradScaler train step `fn` loads one inf/NaN verdict for all ranks (each
    rank holds blocks of the gradients: `_torch.grad_scaler.agree_on_overflow`, one
    AllReduce(MAX) of a scalar per check); returns the functions that undo it."""
    return [agree_on_overflow(s, _max_over_job) for s in grad_scalers(fn)]


def _max_over_job(t: torch.Tensor) -> torch.Tensor:
    """A GradScaler's inf/NaN verdict: the maximum over every rank (`agree_on_overflow`)."""
    with recorder.label("GradScaler: inf/NaN on any rank's blocks"):
        return all_reduce(t, ReduceOp.MAX, None)


def pick_network(modules: list[nn.Module]) -> nn.Module:
    """The referenced module with parameters that contains every other one with parameters.

    Raises:
        ValueError: none contains all the others (the message names them; pass network=).
    """
    with_params = [m for m in modules if any(True for _ in m.parameters())]
    for m in with_params:
        inside = {id(s) for s in m.modules()}
        if all(id(o) in inside for o in with_params):
            return m
    names = [type(m).__name__ for m in with_params]
    raise ValueError(
        f"AutoParallel: the train step references {len(with_params)} modules with parameters "
        f"({names}) and none contains the others; pass network="
    )
