"""The step's differentiation calls under a `_executor.PlanExecutor` (`Differentiate`, one of its
bases).

`Differentiate.differentiate` runs a ``loss.backward()`` / ``torch.autograd.backward`` call or a
``torch.autograd.grad`` call the executor's mode saw. Before it: the plan's pass must have
reached its last op (`_passes.Passes.check_done`; a ``torch.autograd.grad`` that keeps the graph,
``create_graph`` / ``retain_graph``, is no step's differentiation and is not checked), and the
seeds are scaled by 1/N (a split root's by its spread / N: `_seeds.Seeds.scaled_seeds`), so the
gradients inside, and those a ``torch.autograd.grad`` returns, are one device's; the caller is
told what they are still to be divided by (`divide_by`: 1, or N for the seeds `_seeds` leaves
unscaled). A ``backward`` without a gradient runs under
`communication.primitives.replicated_seed` with this run's token (the plan's ``seeded``
adjoints stay local), or without one when an op outside the plan ran since the pass started.
After it, the loss's started AllReduce (which ran alongside) is finished. A ``torch.autograd.grad``
that keeps the graph returns the gradient of a parameter the plan stores as a block (a Megatron
split) gathered whole on every rank (`whole_grads`): the plan's ops reading it take it as a value
whole on every rank (the capture saw its global shape). Under optimizer parallel, whose ops
compute with each parameter's compute weight, a ``torch.autograd.grad`` of a parameter is
refused (`refuse_parameters`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shardwise.communication.primitives import replicated_seed
from shardwise.layout import TensorLayout
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.planner._call_kinds import grad_inputs, keeps_graph
from shardwise.redistribution import redistribute

if TYPE_CHECKING:
    from shardwise.planner import EdgePlan

T = torch.Tensor


class Differentiate:
    """Runs the step's backward and grad calls (see the module docstring); the executor sets
    the state below."""

    finished: bool
    backward_seen: bool
    param_value: Callable[[T], T] | None  # (optimizer parallel's compute weight, else None)
    in_backward: int  # > 0 while a backward of the step runs (`_input_grads`)
    outside: bool
    run: object
    set_divisor: Callable[[int], None] | None

    if TYPE_CHECKING:

        def check_done(self, where: str) -> None: ...

        def scaled_seeds(
            self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], strict: bool = True
        ) -> tuple[tuple[Any, ...], dict[str, Any], int]: ...

        def finish_started(self) -> None: ...

        def _stored(self, t: T) -> tuple[EdgePlan, str] | None: ...

        @property
        def params(self) -> dict[int, str]: ...

    def refuse_parameters(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Under optimizer parallel, a ``torch.autograd.grad`` of a parameter is refused: the
        ops compute with its compute weight (`param_value`), so torch finds no gradient of the
        `Parameter` itself (it raised that the tensor was not used in the graph)."""
        if self.param_value is None:
            return
        for t in grad_inputs(args, kwargs):
            name = self.params.get(id(t)) if isinstance(t, T) else None
            if name is not None:
                raise UnsupportedParallelError(
                    f"torch.autograd.grad of parameter {name!r} in a train step under hsdp(): "
                    f"optimizer parallel computes with a gathered copy of each parameter (its "
                    f"shards over the data-parallel axes put together), not with the Parameter, "
                    f"so the Parameter has no gradient there; take such gradients in a step "
                    f"without hsdp() (there a split weight's gradient is returned whole), or "
                    f"read {name}.grad after loss.backward()"
                )

    def whole_grads(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        """The gradients a ``torch.autograd.grad`` that keeps the graph returned (`out`), each
        of a parameter the plan stores as a block gathered whole (the plan reads them as values
        whole on every rank, one device's: capture saw their global shapes)."""
        grads = list(out)
        changed = False
        for i, (t, g) in enumerate(zip(grad_inputs(args, kwargs), grads, strict=False)):
            stored = self._stored(t) if isinstance(t, T) and isinstance(g, T) else None
            if stored is None:
                continue
            src = stored[0].src.layout
            whole = TensorLayout(src.matrix, ((),) * len(stored[0].shape))
            grads[i] = redistribute(g, src, whole, stored[0].shape)
            changed = True
        return tuple(grads) if changed else out

    def divide_by(self, divisor: int) -> None:
        """Tell the caller what this backward's gradients are still to be divided by."""
        if self.set_divisor is not None:
            self.set_divisor(divisor)

    def differentiate(
        self, func: Callable[..., Any], kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run `func`, a call of `kind` ``"grad"`` or ``"backward"`` (`planner.call_info`)."""
        if kind == "grad":  # (``torch.autograd.grad``: no node)
            self.refuse_parameters(args, kwargs)
            last = not keeps_graph(args, kwargs)
            if last:  # (the graph freed: the step's differentiation, as ``loss.backward()``)
                self.check_done("torch.autograd.grad")
                self.finished = self.backward_seen = True
            args, kwargs, divisor = self.scaled_seeds(func, args, kwargs, strict=last)
            self.divide_by(divisor)
            self.in_backward += 1
            try:
                out = func(*args, **kwargs)
            finally:
                self.in_backward -= 1
                if last:
                    self.finish_started()
            return out if last else self.whole_grads(args, kwargs, out)
        self.check_done("loss.backward()")
        gradient = args[1] if len(args) > 1 else kwargs.get("gradient")  # (before `_seeds`)
        args, kwargs, divisor = self.scaled_seeds(func, args, kwargs)  # (1 / N: `_seeds`)
        self.divide_by(divisor)
        self.finished = self.backward_seen = True  # (may run the plan again: `_restarts`)
        self.in_backward += 1  # (`_input_grads.input_gradients` acts only then)
        try:
            if gradient is None and args and isinstance(args[0], T):
                # (`EdgePlan.seeded` holds for a root the plan made, not one made after it)
                with replicated_seed(args[0], None if self.outside else self.run):
                    out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
        finally:
            self.in_backward -= 1
        self.finish_started()  # (a started AllReduce of the loss ran alongside)
        return out
