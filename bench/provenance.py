"""Which commit a benchmark result measured, for the header of its results file."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    """FLASHTRAIN_COMMIT when set (a device machine's copy of the tree has no .git), else the
    checkout's short HEAD."""
    return os.environ.get("FLASHTRAIN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
