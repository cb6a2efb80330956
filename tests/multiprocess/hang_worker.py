"""Worker of test_hang_real. Usage: hang_worker.py sleep|mismatch.

Every rank all-reduces once (AllReduce #1 of the world group). Then rank 1 either sleeps in
`load_batch` (a data loader that never returns) or, with ``mismatch``, calls AllGather where the
others call AllReduce #2; the others wait in AllReduce #2 until ``SHARDWISE_COMM_TIMEOUT``.
"""

import os
import sys
import time

import torch

from shardwise import communication as comm


def load_batch() -> None:
    time.sleep(600)


mode = sys.argv[1]
comm.init("gloo")
rank = comm.get_rank()
x = comm.AllReduce()(torch.ones(4))
print(f"rank {rank} pid {os.getpid()} ready", flush=True)
if rank == 1 and mode == "sleep":
    load_batch()
elif rank == 1:
    comm.AllGather()(torch.ones(4))
else:
    comm.AllReduce()(x)
