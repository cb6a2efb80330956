"""Two ranks passing different inputs, run under TORCH_DISTRIBUTED_DEBUG=DETAIL by
test_collectives_real.py: every rank must fail naming both.

- `Mismatch`: float64 on rank 0, float32 on rank 1, to one AllReduce (torch's own check);
- `Mismatch-ReduceScatter`, `Mismatch-AlltoAll`: 4 rows on rank 0, 6 on rank 1 (shardwise's
  check: torch's does not compare an all-to-all's shapes, and gloo aborted rank 0).
"""

import torch

import shardwise as sw

sw.communication.init()
rank = sw.communication.get_rank()
try:
    sw.ops.AllReduce()(torch.ones(2, dtype=torch.float64 if rank == 0 else torch.float32))
except RuntimeError as e:
    assert "Detected mismatch between collectives" in str(e), e
    assert "Double" in str(e) and "Float" in str(e), e
    print("CHECK Mismatch OK", flush=True)
rows = torch.ones(4 if rank == 0 else 6, 3)
for name, op in (("ReduceScatter", sw.ops.ReduceScatter()), ("AlltoAll", sw.ops.AlltoAll(2, 0, 1))):
    try:
        op(rows)
    except ValueError as e:
        assert f"{name}: Detected mismatch between collectives" in str(e), e
        assert "rank 0: shape [4, 3] of torch.float32, rank 1: shape [6, 3]" in str(e), e
        print(f"CHECK Mismatch-{name} OK", flush=True)
sw.ops.AllReduce()(torch.ones(1))  # (both ranks still in step)
