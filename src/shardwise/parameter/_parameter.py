"""``sw.Parameter``: a ``torch.nn.Parameter`` that carries MindSpore's parallel attributes.

- `Parameter`: ``name``, ``parallel_optimizer`` and ``comm_fusion`` on top of
  ``nn.Parameter``; keeps them through ``copy.deepcopy``, pickling, ``.to()`` (when no
  autograd graph is recorded) and ``module.to()``.
- `set_comm_fusion`, `comm_fusion_of`, `parallel_optimizer_of`: read and write the
  attributes on any parameter, including plain ``nn.Parameter``s (which get the defaults).
- `assign_tensor`: swap new values into an existing tensor object, keeping its identity,
  class, ``requires_grad`` and attributes (used by materialization and checkpoint loading).
- `tied_names`: each extra name of a tied parameter (a weight two modules share) -> its first.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from shardwise._torch.subclass import make_subclass

DEFAULT_COMM_FUSION = 1
"""MindSpore's ``ParamInfo`` default fusion id: every parameter left alone is fused together."""


def _check_fusion(fusion_id: object) -> int:
    if isinstance(fusion_id, bool) or not isinstance(fusion_id, int) or fusion_id < 0:
        raise ValueError(f"comm_fusion must be an int >= 0, got {fusion_id!r}")
    return fusion_id


class Parameter(torch.nn.Parameter):
    """A trainable tensor with MindSpore's ``name``, ``parallel_optimizer`` and ``comm_fusion``.

    Args:
        data: the initial value (for example ``sw.initializer("normal", [784, 512])``).
        name: a name for reports; ``None`` until set (checkpoints use module paths).
        requires_grad: as for ``torch.nn.Parameter``.
        parallel_optimizer: whether optimizer parallel may shard this parameter.
        comm_fusion: fusion id of its gradient/parameter collectives (default 1, as MindSpore).

    Example:
        >>> p = Parameter(torch.zeros(2, 3), name="w", parallel_optimizer=False)
        >>> p.name, p.parallel_optimizer, p.comm_fusion
        ('w', False, 1)
    """

    def __new__(
        cls,
        data: torch.Tensor | None = None,
        name: str | None = None,
        requires_grad: bool = True,
        parallel_optimizer: bool = True,
        *,
        comm_fusion: int = DEFAULT_COMM_FUSION,
    ) -> Parameter:
        if data is None:
            data = torch.empty(0)
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"Parameter data must be a torch.Tensor, got {type(data).__name__}")
        if type(data) is not torch.Tensor:
            data = data.detach()
        if type(data) is not torch.Tensor and not isinstance(data, torch.nn.Parameter):
            return _marked(data, name, requires_grad, parallel_optimizer, comm_fusion)  # type: ignore[no-any-return]
        param = make_subclass(cls, data, requires_grad)
        param.name = name
        param.parallel_optimizer = parallel_optimizer
        param.comm_fusion = comm_fusion
        return param

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Everything happens in ``__new__``."""

    @property  # type: ignore[override]
    def name(self) -> str | None:
        """The parameter's name (``torch.Tensor.name`` is read-only, hence a property)."""
        value = self.__dict__.get("_sw_name")
        return value if isinstance(value, str) else None

    @name.setter
    def name(self, value: str | None) -> None:
        if value is not None and not isinstance(value, str):
            raise TypeError(f"Parameter name must be a str or None, got {type(value).__name__}")
        self.__dict__["_sw_name"] = value

    @property
    def parallel_optimizer(self) -> bool:
        """Whether optimizer parallel may shard this parameter (MindSpore default True)."""
        return bool(self.__dict__.get("_sw_parallel_optimizer", True))

    @parallel_optimizer.setter
    def parallel_optimizer(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"parallel_optimizer must be a bool, got {value!r}")
        self.__dict__["_sw_parallel_optimizer"] = value

    @property
    def comm_fusion(self) -> int:
        """Fusion id of this parameter's collectives; equal ids share one fused collective."""
        return int(self.__dict__.get("_sw_comm_fusion", DEFAULT_COMM_FUSION))

    @comm_fusion.setter
    def comm_fusion(self, value: int) -> None:
        self.__dict__["_sw_comm_fusion"] = _check_fusion(value)

    def _rebuilt(self, data: torch.Tensor, requires_grad: bool) -> Parameter:
        new = Parameter(data, requires_grad=requires_grad)
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> Parameter:
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        data = self.data.clone(memory_format=torch.preserve_format)
        result = Parameter(data, requires_grad=self.requires_grad)
        memo[id(self)] = result
        result.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return result

    def __reduce_ex__(self, proto: Any) -> tuple[Any, ...]:
        return (_rebuild_parameter, (self.data, self.requires_grad, dict(self.__dict__)))

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        """``torch.Tensor.to``; the result stays an `sw.Parameter` when no graph is recorded.

        Under ``torch.no_grad()`` (as in ``module.to()``) or for a parameter that does not
        require grad, a converted copy is a new `Parameter` with the same attributes. When
        autograd records the conversion, the result is the ordinary differentiable tensor
        (a new leaf would cut the gradient path back to this parameter).
        """
        result = super().to(*args, **kwargs)
        if result is self or isinstance(result, Parameter):
            return result
        if torch.is_grad_enabled() and self.requires_grad:
            return result
        if torch.__future__.get_swap_module_params_on_conversion():
            return result  # module.to() re-wraps it in nn.Parameter, which refuses subclasses
        return self._rebuilt(result.detach(), self.requires_grad)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"Parameter(name={self.name!r}, shape={list(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, requires_grad={self.requires_grad}, "
            f"parallel_optimizer={self.parallel_optimizer}, comm_fusion={self.comm_fusion})"
        )


def _marked(
    data: torch.Tensor,
    name: str | None,
    requires_grad: bool,
    parallel_optimizer: bool,
    comm_fusion: int,
) -> Any:
    """A parameter from a tensor subclass's `data` (one holding every rank's value in a
    simulated world, a DTensor), which cannot be wrapped in another class: `data` itself,
    marked a parameter as ``torch.nn.Parameter`` marks such tensors, with the attributes
    (``name`` kept as ``_sw_name``: a tensor's own ``name`` is read-only)."""
    t = data.requires_grad_(requires_grad)
    t._is_param = True  # type: ignore[attr-defined]
    t.__dict__["_sw_name"] = name
    t.parallel_optimizer = bool(parallel_optimizer)  # type: ignore[attr-defined]
    t.comm_fusion = _check_fusion(comm_fusion)  # type: ignore[attr-defined]
    return t


def _rebuild_parameter(data: torch.Tensor, requires_grad: bool, state: dict[str, Any]) -> Parameter:
    """Unpickling entry point of `Parameter` (keeps class and attributes)."""
    param = Parameter(data, requires_grad=requires_grad)
    param.__dict__.update(state)
    return param


def set_comm_fusion(module: torch.nn.Module, fusion_id: int, recurse: bool = True) -> None:
    """Set ``comm_fusion`` on every parameter of ``module`` (MindSpore ``Cell.set_comm_fusion``).

    Args:
        module: the module whose parameters get the id.
        fusion_id: an int >= 0; parameters with the same id share one fused collective.
        recurse: also the parameters of submodules.

    Returns:
        None.

    Raises:
        TypeError: `module` is not an ``nn.Module``.
        ValueError: `fusion_id` is not an int >= 0.

    Example:
        >>> net = torch.nn.Linear(4, 2)
        >>> set_comm_fusion(net, 3)
        >>> comm_fusion_of(net.weight)
        3
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"set_comm_fusion: module must be an nn.Module (the first argument), got "
            f"{type(module).__name__} {module!r}; call set_comm_fusion(net, fusion_id) "
            f"(MindSpore's net.set_comm_fusion(fusion_id))"
        )
    value = _check_fusion(fusion_id)
    for param in module.parameters(recurse=recurse):
        param.comm_fusion = value  # type: ignore[attr-defined]


def comm_fusion_of(param: torch.Tensor) -> int:
    """The fusion id of any parameter (`DEFAULT_COMM_FUSION` when never set)."""
    return int(getattr(param, "comm_fusion", DEFAULT_COMM_FUSION))


def parallel_optimizer_of(param: torch.Tensor) -> bool:
    """Whether optimizer parallel may shard ``param`` (True unless set to False)."""
    return bool(getattr(param, "parallel_optimizer", True))


def assign_tensor(target: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``target`` hold ``value``'s data in place: same Python object, class and attributes.

    Works across devices, including meta -> real, where ``target.data = value`` is refused;
    optimizers and modules that hold ``target`` see the new data.

    Args:
        target: the tensor or parameter object to update.
        value: the new data (shape and dtype may differ: a local shard, a cast).

    Returns:
        None.

    Example:
        >>> w = torch.nn.Parameter(torch.empty(2, device="meta"))
        >>> assign_tensor(w, torch.ones(2))
        >>> w.device.type
        'cpu'
    """
    data = value.detach()
    if type(target) is torch.Tensor:
        replacement = data.requires_grad_(target.requires_grad)
    else:
        replacement = make_subclass(type(target), data, target.requires_grad)
    replacement.__dict__.update(target.__dict__)
    torch.utils.swap_tensors(target, replacement)


def tied_names(network: nn.Module) -> dict[str, str]:
    """Each extra ``named_parameters`` name of a tied parameter -> its first name.

    Args:
        network: any module.

    Returns:
        ``{"head.weight": "wte.weight"}`` for a head tied to the embedding; ``{}`` if none.

    Example:
        >>> net = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
        >>> net["b"].weight = net["a"].weight
        >>> tied_names(net)
        {'b.weight': 'a.weight'}
    """
    first: dict[int, str] = {}
    out = {}
    for name, p in network.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return {a: n for a, n in out.items() if a != n}
