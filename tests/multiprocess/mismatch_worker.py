"""Rank 0 passes float64, the others float32, to one AllReduce (run under
TORCH_DISTRIBUTED_DEBUG=DETAIL by test_collectives_real.py): every rank must fail naming both."""

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
