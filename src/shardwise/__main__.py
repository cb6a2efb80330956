"""``python -m shardwise run ...`` is ``shardwise run ...``."""

from shardwise.launch.cli import main

if __name__ == "__main__":
    main()
