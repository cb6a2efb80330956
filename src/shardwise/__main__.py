"""``python -m shardwise run ...`` is ``shardwise run ...`` (same exit code)."""

from shardwise.launch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
