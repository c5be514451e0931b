"""python -m agents.node: see agents/node/cli.py."""

from __future__ import annotations

import sys

from agents.node.cli import main

if __name__ == "__main__":
    sys.exit(main())
