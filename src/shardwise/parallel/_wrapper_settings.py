"""`AutoParallel`'s settings made before its first call (`WrapperSettings`, mixed into
`_auto.AutoParallel`): how each input of the wrapped call is split
(`WrapperSettings.dataset_strategy`, checked by `_step.check_dataset_strategy`), optimizer
parallel (`WrapperSettings.hsdp`, checked by `optim.check_hsdp`; the closures of optimizer
steps watched from then on: `_hsdp.watch_closures`) and how gradient / weight collectives are
bucketed (`WrapperSettings.comm_fusion`, checked by `optim.check_fusion`). Each returns the
wrapper, so that calls chain, and raises ValueError once the wrapper has planned or run: the
plan was made with the settings it had then.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

from shardwise.optim import FusionConfig, HsdpConfig, check_fusion, check_hsdp
from shardwise.parallel._hsdp import watch_closures
from shardwise.parallel._step import DatasetStrategy, check_dataset_strategy


class WrapperSettings:
    """The settings methods of `AutoParallel` (which sets the attributes below)."""

    parallel_mode: str
    _dataset: DatasetStrategy
    _hsdp: HsdpConfig | None
    _fusion: FusionConfig | None
    _fusion_dict: dict[str, Any]

    if TYPE_CHECKING:

        @property
        def has_run(self) -> bool: ...

    def dataset_strategy(self, strategy: DatasetStrategy) -> Self:
        """How each input of the wrapped call is split.

        Args:
            strategy: how each rank's inputs relate to the global batch, the same for a
                wrapped module and a wrapped train step: ``"data_parallel"`` (the default:
                each rank passes its own rows; the global batch is the ranks' rows in rank
                order), ``"full_batch"`` (each rank passes the whole global batch; each
                consumer takes its share), or one entry per tensor input, each rank passing its
                block of that layout: split counts such as ``((2, 1), (2,))`` (the repeat
                factor appended on the right when they use fewer devices than the job: ranks
                0-3 pass the first half of the rows on 8 ranks) or Layout calls
                ``(layout("dp", "None"), layout("dp"))``.

        Returns:
            self.

        Example:
            >>> AutoParallel(train_step).dataset_strategy(((4, 1, 1, 1), (4,)))
        """
        if self.has_run:
            raise ValueError(
                "AutoParallel.dataset_strategy: call it before the first step (already planned: "
                "the plan cuts the inputs by the strategy it was made with); wrap the step in a "
                "new AutoParallel for another"
            )
        self._dataset = check_dataset_strategy(strategy)
        return self

    def hsdp(
        self, shard_size: int = -1, threshold: float = 64, optimizer_level: str = "level1"
    ) -> Self:
        """Turn on optimizer parallel (MindSpore's hsdp; see docs/optim.md).

        Args:
            shard_size: ranks one parameter is sharded over; -1: its whole data-parallel group
                (the ranks holding the same op-level block); else a divisor of it (the shards
                are then kept equal across the groups by an AllReduce).
            threshold: KB; smaller parameter blocks are not sharded.
            optimizer_level: ``"level1"`` (optimizer state and update sharded; weights gathered
                once per step and kept for forward and backward; full gradients kept until the
                optimizer step, then reduce-scattered), ``"level2"`` (gradients reduce-scattered
                in backward as soon as a bucket is ready), ``"level3"`` (also weights gathered
                again in backward instead of being kept).

        Returns:
            self.

        Example:
            >>> AutoParallel(train_step, parallel_mode="semi_auto").hsdp(optimizer_level="level2")
        """
        if self.has_run:
            raise ValueError("AutoParallel.hsdp: call it before the first step (already planned)")
        self._hsdp = check_hsdp(shard_size, threshold, optimizer_level, self.parallel_mode)
        watch_closures(self)  # (a first call inside a closure: `stepping_over`)
        return self

    def comm_fusion(self, config: Mapping[str, Any]) -> Self:
        """Bucket gradient / weight collectives by size or index instead of by fusion id.

        Without this call (and without the context's ``comm_fusion``) the gradient AllReduces
        go in buckets of at most 25 MB (DDP's default); with it, a kind without a mode fuses by
        ``comm_fusion`` id (``set_comm_fusion``; id 0: one collective per parameter), and
        ``{"openstate": False}`` gives one collective per parameter.

        Args:
            config: ``{"allreduce" | "allgather" | "reducescatter": {"mode": "auto" | "size" |
                "index", "config": ...}}``: ``auto`` = 64 MB buckets, ``size`` = ``config`` MB,
                ``index`` (allreduce only) = parameter indices where a new bucket starts.
                ``mode`` is required; ``auto`` ignores ``config`` (as MindSpore); another key
                in an entry is a ValueError.

        Returns:
            self.

        Example:
            >>> parallel_net.comm_fusion({"allreduce": {"mode": "size", "config": 32}})
        """
        if self.has_run:
            raise ValueError("AutoParallel.comm_fusion: call it before the first step")
        self._fusion = check_fusion(config)
        self._fusion_dict = dict(config)
        return self
