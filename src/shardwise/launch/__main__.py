"""``python -m shardwise.launch [options] script.py [args]``: the same as ``swrun``."""

import sys

from shardwise.launch.cli import swrun_main

sys.exit(swrun_main(prog="python -m shardwise.launch"))
