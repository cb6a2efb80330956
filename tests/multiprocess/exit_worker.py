"""Worker of test_clean_exit_real. Usage: exit_worker.py clean|raise.

clean: a few collectives, the last one as the script's last statement, and no `release()`:
the process leaves the job at interpreter exit. raise: rank 1 raises after the first AllReduce
while the others wait for it in the next one.
"""

import sys
import time

import torch

from shardwise import communication as comm  # the package alone: a faster start than shardwise

mode = sys.argv[1]
comm.init("gloo")
rank, n = comm.get_rank(), comm.get_group_size()
total = comm.AllReduce()(torch.full((8,), float(rank + 1)))
assert total.tolist() == [n * (n + 1) / 2] * 8, total
if mode == "raise" and rank == 1:
    print(f"raising at {time.time():.3f}", flush=True)
    raise ValueError(f"boom from rank {rank}")
gathered = comm.AllGather()(torch.full((2,), float(rank)))
assert gathered.tolist() == [float(r) for r in range(n) for _ in range(2)], gathered
print(f"rank {rank} ok", flush=True)
comm.AllReduce()(total)  # no release(): the exit comes right after this collective
