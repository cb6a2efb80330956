"""Joins the job with `shardwise.communication.init()` and all-reduces its rank."""

import torch
import torch.distributed as dist

import shardwise.communication as comm

comm.init("gloo")
rank, size = comm.get_rank(), comm.get_group_size()
t = torch.tensor([float(rank)])
dist.all_reduce(t)
print(f"rank {rank} of {size} (local {comm.get_local_rank()}) sum {t.item():g}", flush=True)
comm.release()
