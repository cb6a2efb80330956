"""`run_plan`: execute an OpPlan on every rank's local shards, in one process, without a process
group, and check each rank's outputs against the slice of the single-device result.

This is the reference semantics of a plan (what the distributed runtime must do):

1. every rank takes its block of each input (`plan.inputs[i].local_slice(rank, shape)`);
2. runs the primitive on the blocks (Reshape: with the local target shape; Gather with
   ``local == "masked_lookup"``: indices shifted by the rank's first row, rows it does not hold
   zeroed);
3. applies `plan.comms` in order (AllReduce: sum, mean or max over the group; ReduceScatter:
   sum, then the rank's chunk of `dim` by its position in the group);
4. must then hold exactly `plan.outputs[k].local_slice(rank, output_shape)` of each output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

from shardwise.ops import Gather, OpPlan, Primitive

Outputs = tuple[torch.Tensor, ...]


def _as_tuple(out: torch.Tensor | Sequence[torch.Tensor]) -> Outputs:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _masked_lookup(plan: OpPlan, rank: int, local: list[torch.Tensor], axis: int) -> torch.Tensor:
    params, indices = local
    layout = plan.inputs[0]
    axis %= params.dim()
    rows = params.shape[axis]
    start = layout.block_index(rank, axis) * rows
    shifted = indices - start
    valid = (shifted >= 0) & (shifted < rows)
    out = Gather()(params, shifted.clamp(0, rows - 1), axis)
    shape = [1] * axis + list(indices.shape) + [1] * (params.dim() - axis - 1)
    return out * valid.reshape(shape).to(out.dtype)


def _local_outputs(
    module: Primitive, plan: OpPlan, rank: int, local: list[torch.Tensor], args: dict[str, Any]
) -> Outputs:
    if plan.local == "masked_lookup":
        return (_masked_lookup(plan, rank, local, int(args["axis"])),)
    if "shape" in args:  # Reshape: the local target shape
        args = {**args, "shape": plan.outputs[0].local_shape(plan.output_shapes[0])}
    return _as_tuple(module(*local, **args))


def _apply_comms(plan: OpPlan, partial: dict[int, list[torch.Tensor]]) -> None:
    for comm in plan.comms:
        k = comm.output
        combined = {}
        for rank in plan.matrix.rank_list:
            group = comm.group(plan.matrix, rank)
            total = sum((partial[r][k] for r in group), torch.zeros_like(partial[rank][k]))
            if comm.op == "max":
                total = torch.stack([partial[r][k] for r in group]).amax(dim=0)
            if comm.op == "mean":
                total = total / len(group)
            if comm.kind == "ReduceScatter":
                assert comm.dim is not None
                total = total.chunk(len(group), dim=comm.dim)[group.index(rank)]
            combined[rank] = total
        for rank, value in combined.items():
            partial[rank][k] = value


def run_plan(
    module: Primitive,
    plan: OpPlan,
    inputs: Sequence[torch.Tensor],
    call_args: Mapping[str, Any] | None = None,
) -> None:
    """Assert that executing `plan` rank by rank reproduces the single-device outputs."""
    args = dict(call_args or {})
    full = _as_tuple(module(*inputs, **args))
    assert tuple(tuple(t.shape) for t in full) == plan.output_shapes
    partial: dict[int, list[torch.Tensor]] = {}
    for rank in plan.matrix.rank_list:
        local = [x[t.local_slice(rank, x.shape)] for x, t in zip(inputs, plan.inputs, strict=True)]
        partial[rank] = list(_local_outputs(module, plan, rank, local, args))
    _apply_comms(plan, partial)
    for rank, outs in partial.items():
        for k, (got, layout) in enumerate(zip(outs, plan.outputs, strict=True)):
            want = full[k][layout.local_slice(rank, full[k].shape)]
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"rank {rank} out {k}")


@pytest.fixture
def simulate() -> Callable[..., None]:
    """`run_plan` as a fixture."""
    return run_plan
