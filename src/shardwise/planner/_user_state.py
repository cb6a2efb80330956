"""The capture leaves the train step's Python state as it found it.

The capture runs the network or train step once, on fake tensors (no values), before the first
real call. Whatever that run changes would otherwise stay:

- state the step creates lazily on its first call would keep fake tensors for every later
  call: a ``torch.amp.GradScaler``'s scale (``scaler.scale(loss)`` creates it), a mask or
  cache a module stores on itself, a buffer registered in ``forward``, a running metric
  (``stats["correct"] = stats["correct"] + ...``, ``global total``, a list appended to);
- Python state the step advances would be one call ahead of one device's: a step counter
  (``self.t += 1``; a schedule or cycle read from it), a list of losses, Python's and NumPy's
  random generators (``random.choice``).

`python_state` notes each object the step's code loads (its attributes; a module's public ones,
its buffers; a random generator object's state), each dict, list and set, the containers and
objects inside those (``stats["hist"]``, a ``GradScaler`` kept in a dict or in a config
object's attribute), each closure cell, and the global random generators' states (the objects
are those the step's code and its modules' hooks load: `parallel/_discover.find_objects`,
`hook_objects`); the function
it returns puts back every one that changed. `kept_real` does so around the capture, so the
first real call starts where the capture started; the wrapper does so around each call
(`parallel/_graph_run.py`), for a call stopped part way to be planned again (another branch of
the step) and run anew from where it started; `module_attributes` notes, at each call, every
module's own attributes (``self.pos += t`` before an op that stops the call would otherwise
count twice). A module's private attributes (``_parameters``,
hooks) are only rid of fake tensors (the capture restores its parameters itself).
"""

from __future__ import annotations

import random
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shardwise._torch import pytree
from shardwise._torch.fake import holds_fake
from shardwise._torch.module_state import own_buffers

_LIMIT = 200_000  # container items looked through for nested containers (a dataset's list)
CALL_LIMIT = 2_000  # the same, for the note taken at every call (`parallel/_graph_run.py`)
_CONTAINERS = (list, dict, set)
_EMPTY = object()


def _fake(value: Any) -> bool:
    """Whether `value` is a fake tensor or a list / tuple / dict holding one."""
    if holds_fake(value):
        return True
    if isinstance(value, list | tuple | dict):
        return any(holds_fake(leaf) for leaf in pytree.tree_leaves(value))
    return False


def _drop_fakes(store: dict[str, Any], before: dict[str, Any]) -> None:
    """In `store` (a module's ``__dict__`` or ``_buffers``): each value set or added holding a
    fake tensor back to what `before` had, or removed when it had none."""
    for name, value in list(store.items()):
        if value is not before.get(name) and _fake(value):
            old = before.get(name)
            if name in before and not _fake(old):
                store[name] = old
            else:
                del store[name]


def _put_dict(store: dict[Any, Any], before: dict[Any, Any], public: bool = False) -> None:
    """`store` back to `before` (each key that changed, was added or removed); with `public`
    only the keys not starting with ``_`` (a module's attributes), the others rid of fakes."""
    if public:
        _drop_fakes(store, before)
    for key in [k for k in store if k not in before]:
        if not (public and str(key).startswith("_")):
            del store[key]
    for key, value in before.items():
        if public and str(key).startswith("_"):
            continue
        if key not in store or store[key] is not value:
            store[key] = value


def _put_list(items: list[Any], before: list[Any]) -> None:
    if len(items) != len(before) or any(a is not b for a, b in zip(items, before, strict=True)):
        items[:] = before


def _put_set(items: set[Any], before: set[Any]) -> None:
    if items != before:
        items.clear()
        items.update(before)


def _content(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell)
        return _EMPTY


def _put_cell(cell: types.CellType, before: Any) -> None:
    """A closure cell back to what it held (``nonlocal total``)."""
    if _content(cell) is before:
        return
    if before is _EMPTY:
        del cell.cell_contents
    else:
        cell.cell_contents = before


class _Snapshot:
    """The undo steps of one capture (see the module docstring)."""

    def __init__(self, limit: int) -> None:
        self.undo: list[Callable[[], None]] = []
        self.seen: set[int] = set()
        self.items = 0
        self.limit = limit

    def take(self, obj: Any, root: bool = False) -> None:
        """Note how `obj` is now, and the plain containers it holds (a `root`, an object the
        step loads, whatever the items noted so far; the containers inside up to `limit`
        items looked through)."""
        if id(obj) in self.seen or (self.items > self.limit and not root):
            return
        self.seen.add(id(obj))
        inside: Iterable[Any]
        if isinstance(obj, list):
            before_list = list(obj)
            self.undo.append(lambda: _put_list(obj, before_list))
            inside = before_list
        elif isinstance(obj, dict):
            before_dict = dict(obj)
            self.undo.append(lambda: _put_dict(obj, before_dict))
            # (a module's globals: the names the step loads are noted themselves)
            inside = () if "__builtins__" in before_dict else before_dict.values()
        elif isinstance(obj, set):
            before_set = set(obj)
            self.undo.append(lambda: _put_set(obj, before_set))
            inside = ()
        elif isinstance(obj, types.CellType):
            content = _content(obj)
            self.undo.append(lambda: _put_cell(obj, content))
            inside = (content,)
        else:
            generator = _generator_state(obj)
            if generator is not None:
                self.undo.append(generator)
            inside = self._attributes(obj)
        for value in inside:
            if self.items > self.limit:
                break
            self.items += 1
            if isinstance(value, _CONTAINERS) or _stateful(value):
                self.take(value)

    def _attributes(self, obj: Any) -> Iterable[Any]:
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            return ()
        before = dict(attrs)
        module = isinstance(obj, nn.Module)
        self.undo.append(lambda: _put_dict(attrs, before, public=module))
        if module:
            buffers = own_buffers(obj)
            if buffers is not None:
                before_buffers = dict(buffers)
                self.undo.append(lambda: _drop_fakes(buffers, before_buffers))
            return [v for k, v in before.items() if k[:1] != "_"]  # (a trainer's self.scaler)
        return before.values()


_ATOMS = frozenset(
    {int, float, bool, str, bytes, complex, tuple, type(None), torch.Tensor, nn.Parameter}
)
_PLAIN = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    type,
    torch.Tensor,
)


def _stateful(value: Any) -> bool:
    """Whether `value`, held in a container or an object noted, is an object with state of its
    own to note (a ``GradScaler`` in a dict, a config object's member): one with a
    ``__dict__`` or a random generator, not a function, class, Python module or tensor."""
    if type(value) in _ATOMS or isinstance(value, _PLAIN):
        return False
    return isinstance(getattr(value, "__dict__", None), dict) or _generator_state(value) is not None


def python_state(
    objects: Iterable[Any], limit: int = _LIMIT, numpy_random: bool = True
) -> Callable[[], None]:
    """A function that puts the Python state of `objects` back as it is now (see the module
    docstring): an object's attributes (a module's public ones and buffers), a random
    generator object's state, a dict's, list's or set's items and the containers inside, a
    closure cell's content; and Python's global random generator, NumPy's too with
    `numpy_random` (reading it costs tens of microseconds). The items of containers looked
    through for nested ones stop at `limit` (each of `objects` is noted whatever the count).

    Example:
        >>> put_back = python_state([trainer, history])
        >>> trainer.t += 1; history.append(0.5)
        >>> put_back()   # trainer.t and history as they were
    """
    snapshot = _Snapshot(limit)
    for obj in objects:
        snapshot.take(obj, root=True)
    generators = _random_states(numpy_random)

    def put_back() -> None:
        for step in snapshot.undo:
            step()
        generators()

    return put_back


def module_attributes(modules: Iterable[nn.Module]) -> Callable[[], None]:
    """A function that puts each of `modules`' public attributes back as they are now (a
    shallow note of its ``__dict__``: a value rebound, added or deleted; a container changed in
    place is `python_state`'s). Cheap enough for every call: one dict copy per module.

    Example:
        >>> put_back = module_attributes(net.modules())
        >>> net.pos += 1
        >>> put_back()   # net.pos as it was
    """
    notes = [(m.__dict__, m.__dict__.copy()) for m in modules]

    def put_back() -> None:
        for attrs, before in notes:
            _put_dict(attrs, before, public=True)

    return put_back


@contextmanager
def kept_real(objects: Iterable[Any]) -> Iterator[None]:
    """Put back, on leaving, the Python state of `objects` as `python_state` notes it.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> with kept_real([scaler]), FakeTensorMode():
        ...     scaler.scale(torch.ones(()))   # creates scaler._scale: a fake tensor
        >>> scaler._scale is None
        True
    """
    put_back = python_state(objects)
    try:
        yield
    finally:
        put_back()


def _generator_state(obj: Any) -> Callable[[], None] | None:
    """For a random generator object (``random.Random``, NumPy's ``Generator`` /
    ``RandomState``: state kept outside their ``__dict__``), a function that puts its state
    back as it is now; None for any other object."""
    if isinstance(obj, random.Random):
        state = obj.getstate()
        return lambda: obj.setstate(state)
    if not type(obj).__module__.startswith("numpy.random"):
        return None
    bits = getattr(obj, "bit_generator", None)
    if bits is not None and hasattr(bits, "state"):  # (numpy.random.Generator)
        bit_state = bits.state
        return lambda: setattr(bits, "state", bit_state)
    if callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None)):
        try:  # (numpy.random.RandomState)
            legacy = obj.get_state()
        except TypeError:
            return None
        return lambda: obj.set_state(legacy)
    return None


def _random_states(numpy_random: bool) -> Callable[[], None]:
    """A function that puts Python's global random generator back as it is now, and NumPy's
    with `numpy_random`."""
    state = random.getstate()
    if not numpy_random:
        return lambda: random.setstate(state)
    try:
        import numpy as np
    except ImportError:  # (NumPy is optional)
        return lambda: random.setstate(state)
    np_state = np.random.get_state()

    def put_back() -> None:
        random.setstate(state)
        np.random.set_state(np_state)

    return put_back
