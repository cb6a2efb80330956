"""One job of 4 real gloo processes for the tests that need 4 ranks and nothing else of their
own (the ``four_rank_job`` fixture): the checks of real_collectives_worker.py, manual_dp_worker.py
(its results as JSON into the folder given as the argument) and tests/parallel/
zoo_semi_auto_worker.py, one after the other in the same processes (each start of a 4-process
job costs ~7 s of imports on 2 cores). A check that fails raises: the job fails, naming the rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))

import manual_dp_worker
import real_collectives_worker
import zoo_semi_auto_worker

import shardwise as sw

if __name__ == "__main__":
    sw.communication.init()
    real_collectives_worker.checks()
    manual_dp_worker.checks(Path(sys.argv[1]))
    zoo_semi_auto_worker.checks()
    sw.communication.release()
