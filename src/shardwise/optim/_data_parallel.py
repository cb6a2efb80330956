"""Data-parallel mode (MindSpore ``parallel_mode="data_parallel"``), with optional optimizer
parallel (seed 001: parameters grouped, each group updated on one rank, then broadcast).

Every rank holds the whole network and runs it on its rows of each global batch: the rows it
passes (dataset strategy ``"data_parallel"``, MindSpore's default) or its rows cut from the whole
batch it passes (``"full_batch"``). Which function does which step:

- `DataParallelRunner.__init__` checks the arguments (`check_arguments`), gives a network
  built in ``sw.no_init_parameters()`` its whole values on every rank (`materialized`), builds
  the plan (``_data_parallel_runner_plan.RunnerPlan._build_plan``: each parameter's optimizer
  and owner rank, the gradient all-reduce and broadcast buckets; planned again when parameters
  are frozen or unfrozen, `RunnerPlan._check_plan`; read by `RunnerPlan.owners`, ``owned``,
  ``collectives_per_step`` and ``str(runner)``) and registers two hooks on every optimizer
  (``register_step_pre_hook`` / ``register_step_post_hook``), which find the optimizer's
  index at each step.
- `DataParallelRunner.__call__`: under ``"full_batch"`` cuts each tensor input to this rank's
  rows (`local_rows`); train-step form: runs the user's step unchanged on the rows, averages the
  returned loss over the ranks (`mean_loss`); module form: runs the network on the rows, its
  loss (a floating 0-d output) averaged over the ranks in value, its gradient this rank's (under
  ``"full_batch"`` the other outputs gathered whole again, `module_outputs`).
- `DataParallelRunner._before_step` (the optimizer's step pre-hook; with a closure, whose
  backward runs inside the step, `_average` as it returns: the closure is handed on wrapped):
  all-reduces the gradients (/ world size, then SUM), one per bucket (`all_reduce_bucket`);
  with ``parallel_optimizer=True`` hides (``grad = None`` for the step) the gradients of the
  parameters no rank of this process owns and drops their optimizer state (a checkpoint
  loaded whole gives every rank all of it): the optimizer updates only its own parameters.
- ``_data_parallel_hooks``: the step hooks, the adopting hook (an optimizer the runner was not
  given is taken at its first step, `DataParallelRunner.adopt`; one holding all the parameters
  of known optimizers replaces them: their hooks go, the plan is made again), and
  `state_on_owners` (whether a network's runner keeps optimizer state on owner ranks: its
  checkpoint files then record the job's size).
- `DataParallelRunner._after_step` (the step post-hook): with ``parallel_optimizer=True``,
  gives the hidden parameters their averaged gradients back (every rank then holds one
  device's ``.grad`` after the step: a gradient-norm log reads it, a step without
  ``zero_grad`` adds to it) and broadcasts each owner's updated parameters to every rank, one
  flat broadcast per (owner, fusion id) bucket (`broadcast_bucket`); each averaged gradient is
  noted, so that `DataParallelRunner.unreduced` tells a gradient backward made or changed since
  (torch's clipping outside a wrapped call refuses those: ``parallel._held_clip``).

The tensor work of those steps (collectives, batch cut) is in ``_data_parallel_steps``.
A process updates the parameters owned by the ranks it runs (`communication.process_ranks`):
in a job, its own rank's and the shared ones. A process running every rank (a simulated world)
updates every parameter with one optimizer object: all ranks hold the same reduced gradients,
so the values are those the owner computes, and the broadcasts are issued all the same.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise import communication as comm
from shardwise._torch.storage import version
from shardwise.optim._data_parallel_hooks import (
    RUNNERS,
    adopt_hook,
    step_hook,
)
from shardwise.optim._data_parallel_plan import (
    WHO,
    CommBucket,
    ParamEntry,
    apart,
    check_arguments,
    check_optimizers,
    find_optimizers,
    materialized,
)
from shardwise.optim._data_parallel_runner_plan import RunnerPlan
from shardwise.optim._data_parallel_steps import (
    all_reduce_bucket,
    broadcast_bucket,
    check_updates,
    full_batch_rows,
    mean_loss,
    module_outputs,
    same_shapes,
)
from shardwise.optim._global_hooks import register_pre, remove_later
from shardwise.optim._settings import FusionConfig, check_fusion


class DataParallelRunner(RunnerPlan):
    """Data-parallel training of a train step or a module (MindSpore parallel_mode="data_parallel").

    Two forms:

    - train step (`train_step` given): every rank calls ``runner(x, y, ...)`` with its rows of
      the global batch (``dataset_strategy="data_parallel"``, the default: each rank reads its
      own share of the data, e.g. ``num_shards=n, shard_id=rank``) or with the whole global
      batch (``"full_batch"``: each tensor input is then cut to this rank's rows, dim 0 split
      over the ranks in rank order); the step runs unchanged on the rows (forward,
      ``loss.backward()``, ``optimizer.step()``, ...) and the returned loss (every floating
      scalar tensor it returns) is averaged over the ranks, so it equals the single-device loss
      of the global batch.
    - module (`train_step` None): ``runner(x, ...)`` runs the network on this rank's rows (as
      above); under ``"full_batch"`` the output is gathered whole on every rank. A loss it
      returns (each floating 0-d output: ``out.loss``, a bare one) is the ranks' mean with this
      rank's gradient (`module_outputs`). The caller calls ``backward()`` and
      ``optimizer.step()`` itself.

    In both forms the gradients are averaged over the ranks inside ``optimizer.step()``, by a
    step pre-hook on each of `optimizers` (and on any other optimizer over the network's
    parameters, from its first step, `adopt_hook`; one holding all the parameters of known
    optimizers, swapped in or built anew in each call, replaces them in `optimizers`), before
    the update: the gradients
    seen by the update are those of the global batch. Only parameters of some optimizer are
    reduced; a train step changing a parameter without such a step raises ValueError
    (`check_updates`).

    With ``parallel_optimizer=True`` each parameter that allows it (`parallel_optimizer_of`)
    and holds at least ``threshold_kb`` KiB gets one owner rank (a greedy byte balance in
    parameter order, `owners`); only the owner updates it (the others see ``grad = None`` during
    the step, so any ``torch.optim`` optimizer keeps state for the owned parameters only) and a
    step post-hook gives the others their averaged gradient back and broadcasts it from its
    owner to every rank, one fused broadcast per (owner, fusion id). Smaller or opted-out
    parameters are updated by every rank.

    Args:
        network: the model (every rank holds all of it).
        optimizers: the optimizers over `network`'s parameters. Empty with a `train_step`:
            those the step refers to (closure cells, globals).
        train_step: the user's step function, or None for the module form.
        parallel_optimizer: group the parameter updates by owner rank, then broadcast.
        threshold_kb: smallest parameter (KiB) that optimizer parallel assigns to one owner.
        fusion: MindSpore's ``comm_fusion`` dict, checked by ``optim.check_fusion`` (the same
            rules as ``AutoParallel.comm_fusion``). ``openstate`` False: one collective per
            parameter. ``allreduce``: absent: one all-reduce per ``comm_fusion`` id (id 0
            alone); ``{"mode": "size", "config": MiB}`` / ``{"mode": "auto"}`` (64 MiB buckets
            of consecutive parameters); ``{"mode": "index", "config": [i, ...]}`` (a new bucket
            at each network parameter index). ``allgather`` / ``reducescatter`` are accepted
            and unused (semi-auto only). Broadcasts always fuse by fusion id.
        dataset_strategy: ``"data_parallel"`` (each rank passes its own rows of the global
            batch) or ``"full_batch"`` (each rank passes the whole global batch).

    Raises:
        RuntimeError: no process group (``shardwise.communication.init()`` not called).
        TypeError: a non-module network, a non-optimizer, a non-bool `parallel_optimizer`.
        ValueError: an unknown `dataset_strategy`; ``threshold_kb < 0``; no optimizer with
            ``parallel_optimizer=True``; an optimizer holding a parameter that is not
            `network`'s, or one held by two optimizers (without `parallel_optimizer`, two
            over exactly the same parameters are not: the later is taken when it steps); a
            bad `fusion`.

    Example:
        >>> optimizer = torch.optim.Adam(net.parameters(), 1e-3)
        >>> def train_step(x, y):
        ...     loss = loss_fn(net(x), y)
        ...     loss.backward(); optimizer.step(); optimizer.zero_grad()
        ...     return loss
        >>> runner = DataParallelRunner(net, [optimizer], train_step=train_step,
        ...                             parallel_optimizer=True)
        >>> loss = runner(images, labels)   # this rank's rows of the global batch
        >>> print(runner)                   # the plan: owners, fusion ids, buckets
    """

    def __init__(
        self,
        network: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        train_step: Callable[..., Any] | None = None,
        parallel_optimizer: bool = False,
        threshold_kb: float = 64,
        fusion: dict[str, Any] | None = None,
        dataset_strategy: Any = "data_parallel",
    ) -> None:
        check_arguments(network, train_step, parallel_optimizer, threshold_kb, dataset_strategy)
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        opts = list(optimizers)
        if not opts and train_step is not None:
            opts = find_optimizers(train_step)
        check_optimizers(opts, parallel_optimizer, train_step is not None)
        if not parallel_optimizer:  # (one over another's very parameters: taken when it steps)
            opts = apart(opts)
        if not comm.is_initialized():
            raise RuntimeError(
                f"{WHO}: no job yet; call shardwise.communication.init() first (or build the "
                "runner inside shardwise.testing.simulated_world)"
            )
        materialized(network, opts)  # (built in sw.no_init_parameters(): its values now)
        self.network = network
        self._params = list(network.parameters())  # (listed once: checked every call)
        self._stepped: list[torch.optim.Optimizer] | None = []  # (stepped in a checked call)
        self.stepping = 0  # known optimizers' steps running now
        self._checked_batch = False  # (``"full_batch"``: `same_batch` ran)
        self.optimizers = opts
        self.train_step = train_step
        self.dataset_strategy: str = dataset_strategy
        self.parallel_optimizer = parallel_optimizer
        self.threshold_kb = float(threshold_kb)
        self._fusion = FusionConfig() if fusion is None else check_fusion(fusion)
        self.world = comm.get_group_size()
        self._ranks = comm.process_ranks()  # the ranks whose parameters this process updates
        self.entries: list[ParamEntry] = []
        self._grad_buckets: list[list[CommBucket]] = []
        self._broadcast_buckets: list[list[CommBucket]] = []
        # (each optimizer's step, by id: the averaged gradients hidden from it, given back after)
        self._hidden: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        # (each parameter's averaged gradient after its optimizer's step, and its version then)
        self._reduced: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._removed = False
        self._build_plan()
        ref = weakref.ref(self)
        self._handles: list[RemovableHandle] = []
        self._step_handles: list[list[RemovableHandle]] = []  # (per optimizer, in its order)
        for o in opts:
            self._step_handles.append(self._hook(o))
        # (one built after the wrapper, or not found in the step: adopted at its first step)
        self._handles.append(register_pre(adopt_hook(ref)))
        # (collected: its hooks, which hold it weakly, go at a safe point: `_global_hooks`)
        self._finalizer = weakref.finalize(self, remove_later, self._handles)
        RUNNERS[network] = ref

    def _hook(self, o: torch.optim.Optimizer) -> list[RemovableHandle]:
        """Register optimizer `o`'s step pre- and post-hook (also kept for `remove`)."""
        ref = weakref.ref(self)
        handles = [
            o.register_step_pre_hook(step_hook(ref, after=False)),
            o.register_step_post_hook(step_hook(ref, after=True)),
        ]
        self._handles.extend(handles)
        return handles

    def _index(self, o: torch.optim.Optimizer) -> int | None:
        """The position of optimizer `o` in `optimizers` (None: not, or no longer, known)."""
        return next((i for i, known in enumerate(self.optimizers) if known is o), None)

    def is_current(self) -> bool:
        """Whether this runner is its network's latest (not replaced by a newer wrapper)."""
        ref = RUNNERS.get(self.network)
        return ref is not None and ref() is self

    def adopt(self, o: torch.optim.Optimizer, replacing: Sequence[int] = ()) -> None:
        """Take optimizer `o` (over the network's parameters, built after the runner, not yet
        the runner's) as one of its optimizers, from the step it is in: its own step hooks,
        registered now, run in it. The known optimizers at the indices `replacing` (all their
        parameters are `o`'s: a swap, one built anew in each call) leave `optimizers` and
        their hooks are removed; `o` takes the first one's place (else it goes last) and the
        plan is made again for the optimizers as they are now."""
        place = min(replacing, default=len(self.optimizers))
        for i in sorted(replacing, reverse=True):  # (not inside their step: `adopt_hook`)
            del self.optimizers[i]
            for handle in self._step_handles.pop(i):
                handle.remove()
                self._handles.remove(handle)
        self.optimizers.insert(place, o)
        self._build_plan()
        self._step_handles.insert(place, self._hook(o))

    # -- running ---------------------------------------------------------------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run one train step (train-step form), or the network (module form), on this rank's
        share of the global batch.

        Args:
            *inputs: under ``dataset_strategy="data_parallel"`` this rank's rows of the global
                batch (the global batch is the ranks' rows in rank order; every rank passes the
                same number of rows); under ``"full_batch"`` the whole global batch, of which
                each tensor input, also one in a tuple, list, dict or dataclass (a cache passed
                back), is cut to this rank's rows (`local_rows`).
            **kwargs: keyword inputs, taken as `inputs` are (``input_ids=...``).

        Returns:
            Train-step form: the step's result with its loss averaged over the ranks; module
            form: the network's output on this rank's rows (``"full_batch"``: every tensor
            output gathered whole on every rank, autograd-aware), its floating 0-d tensors (the
            loss) the ranks' mean in value (`module_outputs`).

        Raises:
            ValueError: (``"full_batch"``) a tensor input whose dim 0 does not divide by the
                number of ranks.

        Example:
            >>> loss = runner(images, labels)   # this rank's rows
        """
        self._check_plan()
        self.stepping = 0  # (a step that raised never ran its post-hook)
        same_shapes([*inputs, *kwargs.values()])
        if self.dataset_strategy == "full_batch":  # (the first call: `same_batch` too)
            inputs, kwargs = full_batch_rows(inputs, kwargs, self.world, not self._checked_batch)
            self._checked_batch = True
        if self.train_step is None:
            out = self.network(*inputs, **kwargs)
            return module_outputs(out, self.world, self.dataset_strategy == "full_batch")
        if self._stepped is None:  # (until a step that changed the weights was checked)
            return mean_loss(self.train_step(*inputs, **kwargs), self.world)
        self._stepped = []
        before = [version(p) for p in self._params]
        out = self.train_step(*inputs, **kwargs)
        if check_updates(self.network, self._params, before, self._stepped, self.optimizers):
            self._stepped = None
        return mean_loss(out, self.world)

    def _before_step(self, o: torch.optim.Optimizer, closure: bool = False) -> None:
        """Step pre-hook of known optimizer `o`: average its gradients, hide the non-owned ones
        from the step (`_after_step` gives them back); with a `closure`, whose backward runs
        inside the step, that is done when it returns (`closure_hook`)."""
        self.stepping += 1  # (an optimizer it steps inside, a Lookahead's, is not adopted)
        self._check_plan()  # (a parameter unfrozen inside the step: its gradient averaged too)
        if self._stepped is not None:
            self._stepped.append(o)
        if not closure:
            self._average(o)

    def _average(self, o: torch.optim.Optimizer) -> None:
        """Average optimizer `o`'s gradients, hide the non-owned ones from its update."""
        index = self._index(o)
        if index is None:  # (no longer known: replaced, its hooks removed)
            return
        if any(p.grad is not None for p in self._params):  # (no backward ran: none, as DDP)
            for bucket in self._grad_buckets[index]:
                all_reduce_bucket(bucket.entries, self.world)
        state = o.state
        hidden = self._hidden[id(o)] = []  # (a step that raised: its gradients stay None)
        for bucket in self._broadcast_buckets[index]:
            if bucket.root not in self._ranks:  # updated by its owner's process
                for e in bucket.entries:
                    if e.param.grad is not None:
                        hidden.append((e.param, e.param.grad))
                        e.param.grad = None
                    state.pop(e.param, None)  # (loaded whole: would be saved, never updated)

    def _after_step(self, o: torch.optim.Optimizer) -> None:
        """Step post-hook of known optimizer `o`: give the hidden gradients back (one device's
        ``.grad`` after the step, on every rank), broadcast each owned bucket from its owner."""
        self.stepping = max(0, self.stepping - 1)
        for param, grad in self._hidden.pop(id(o), []):
            if param.grad is None:  # (the step did not set one)
                param.grad = grad
        index = self._index(o)
        for bucket in [] if index is None else self._broadcast_buckets[index]:
            assert bucket.root is not None
            broadcast_bucket([e.param for e in bucket.entries], bucket.root)
        if index is not None:
            held = {id(p) for group in o.param_groups for p in group["params"]}
            for p in self._params:
                if id(p) in held and p.grad is not None:
                    self._reduced[id(p)] = (weakref.ref(p.grad), version(p.grad))

    def unreduced(self, grads: Sequence[torch.Tensor]) -> str | None:
        """The name of a parameter whose ``.grad`` is among `grads` and is still this rank's
        own: made or changed by a backward since its optimizer's step averaged it (None: no
        such gradient, or the runner removed)."""
        listed = {id(g) for g in grads}
        for name, p in [] if self._removed else self.network.named_parameters():
            g = p.grad
            if g is None or id(g) not in listed:
                continue
            ref, seen = self._reduced.get(id(p), (None, -1))
            if ref is None or ref() is not g or version(g) != seen:
                return name
        return None

    def remove(self) -> None:
        """Remove the optimizer hooks (also done when the runner is garbage collected).

        Returns:
            None.

        Example:
            >>> runner.remove()   # the optimizers step as plain single-process ones again
        """
        self._finalizer.detach()
        self._removed = True
        for handle in self._handles:  # (a call of the user's, not inside a step: at once)
            handle.remove()
