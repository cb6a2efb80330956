"""Started directly (no launcher), as mpirun or a rank table would: init(), check, all-reduce.
Prints one JSON line with what it saw."""

import json

import torch
import torch.distributed as dist

import shardwise.communication as comm

comm.init("gloo")
rank, size = comm.get_rank(), comm.get_group_size()
t = torch.tensor([float(rank + 1)])
if size > 1:
    dist.all_reduce(t)
print("RESULT " + json.dumps({"rank": rank, "size": size, "local": comm.get_local_rank(),
                              "sum": t.item()}), flush=True)  # fmt: skip
comm.release()
