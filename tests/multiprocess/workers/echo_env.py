"""Prints what the launcher gave this worker: rank, argv, cores. No torch import."""

import json
import os
import sys

print(f"hello from rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}")
print("ARGV " + json.dumps(sys.argv[1:]))
print("CORES " + json.dumps(sorted(os.sched_getaffinity(0))))
print("ENV " + json.dumps({k: os.environ[k] for k in ("LOCAL_RANK", "GROUP_RANK", "RANK_ID")}))
