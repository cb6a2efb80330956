"""Entry point of one benchmark worker process: ``python -m bench._worker SPEC_JSON``.

`bench.harness.spawn` starts one per rank with torchrun-style environment variables. `main`
reads the spec (``target`` = ``"module:function"``, ``args``, ``result_dir``), sizes torch's
thread pool to this rank's share of the cores, joins the job with
``shardwise.communication.init("gloo")``, calls the target, writes its return value to
``result_dir/rank<R>.json`` and leaves the job (`release`).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path


def main(spec_path: str) -> None:
    import torch

    from shardwise import communication as comm

    spec = json.loads(Path(spec_path).read_text())
    module_name, _, func_name = spec["target"].partition(":")
    target = getattr(importlib.import_module(module_name), func_name)
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    comm.init("gloo")
    # No try/finally: a failing rank must exit at once (its peers sit in a collective and
    # `spawn` kills them); release()'s barrier would wait for them instead.
    result = target(spec["args"])
    out = Path(spec["result_dir"]) / f"rank{comm.get_rank()}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    comm.release()


if __name__ == "__main__":
    main(sys.argv[1])
