"""A torch-function mode that steps aside while an optimizer steps (`SteppingMode`, the base of
`_executor.PlanExecutor`).

`GraphRun` registers global optimizer step hooks that call `SteppingMode.step_starts` and
`step_ends` around each step inside a wrapped call. A step without a closure is not the plan's
work: its ops pass unexamined. When the mode is the top of the torch-function mode stack it is
taken off the stack for the step (`_lift`: an optimizer's hundreds of update ops then never
reach Python here) and put back where it was when the step ends (`_relist`); under another mode
it stays on the stack, paused (`paused`, which the executor also counts up while a primitive
runs). A step that raised is ended by the next step of the same optimizer, by the step around
it, or by leaving the mode (`__exit__`, which then has nothing to pop).
"""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode

from shardwise._torch.function_modes import (
    get_function_stack_at,
    len_torch_function_stack,
    pop_torch_function_stack,
    push_on_torch_function_stack,
)


class SteppingMode(TorchFunctionMode):
    """The optimizer-step bookkeeping of a torch-function mode (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = 0  # > 0: calls pass unexamined
        # running optimizer steps: (id, paused, lifted off the mode stack)
        self.stepping: list[tuple[int, bool, bool]] = []
        self.lifted = False  # off the mode stack (during an optimizer step)
        self.depth = 0  # (where on the stack it was when lifted)

    def step_starts(self, optimizer: Any, closure: bool) -> None:
        """An optimizer steps: without a closure its ops pass unexamined until `step_ends` (a
        closure re-runs the network: examined). A step of the same optimizer still open is one
        that raised: it ends here."""
        if any(key == id(optimizer) for key, _, _ in self.stepping):
            self.step_ends(optimizer)
        lifted = not closure and self._lift()
        self.stepping.append((id(optimizer), not closure, lifted))
        self.paused += not closure

    def step_ends(self, optimizer: Any) -> None:
        """The step of `optimizer` ended; steps inside it that raised end with it."""
        while self.stepping:
            key, paused, lifted = self.stepping.pop()
            self.paused -= paused
            if lifted and not self.stay_lifted():
                self._relist()
            if key == id(optimizer):
                return

    def stay_lifted(self) -> bool:
        """When a step that lifted this mode ends: whether it stays off the stack (a subclass
        puts itself back later)."""
        return False

    def _lift(self) -> bool:
        """Take this mode off the top of the mode stack (False: it is not the top)."""
        depth = len_torch_function_stack()
        if self.lifted or not depth or get_function_stack_at(depth - 1) is not self:
            return False
        pop_torch_function_stack()
        self.lifted, self.depth = True, depth - 1
        return True

    def _relist(self) -> None:
        """Back onto the mode stack where `_lift` took it from (under modes entered since,
        which then leave the stack in their own order)."""
        above = []
        while len_torch_function_stack() > self.depth:
            above.append(pop_torch_function_stack())
        push_on_torch_function_stack(self)
        for mode in reversed(above):
            push_on_torch_function_stack(mode)
        self.lifted = False

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        """Leave the mode stack (a step that raised left this mode off it already)."""
        self.stepping.clear()
        if self.lifted:
            self.lifted = False
            return
        super().__exit__(exc_type, exc_val, exc_tb)
