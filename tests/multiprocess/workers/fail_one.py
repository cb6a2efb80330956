"""One rank fails (an exception, or SIGKILL), the others wait; every rank also starts a child
process. Usage: fail_one.py FAIL_RANK exception|sigkill MARKER PID_DIR [DELAY_S [stubborn]]
(stubborn: the other ranks ignore SIGTERM, so the launcher has to SIGKILL them).

Each worker writes its pid and its child's pid to PID_DIR; the child carries MARKER on its
command line, so a test can find any process of the job that outlived it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

fail_rank, mode, marker, pid_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
delay = float(sys.argv[5]) if len(sys.argv) > 5 else 0.5
rank = int(os.environ["RANK"])
if len(sys.argv) > 6 and sys.argv[6] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker])
(pid_dir / f"{rank}.pids").write_text(f"{os.getpid()} {child.pid}\n")
print(f"rank {rank} ready", flush=True)
if rank == fail_rank:
    time.sleep(delay)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"boom from rank {rank}")
time.sleep(120)
