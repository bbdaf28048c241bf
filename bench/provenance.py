"""Which commit a benchmark result measured, for the header of its results file, and the header
itself (commit, date, device, versions) for the scripts that write one object."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    """FLASHTRAIN_COMMIT when set (a device machine's copy of the tree has no .git), else the
    checkout's short HEAD."""
    return os.environ.get("FLASHTRAIN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()


def header(benchmark: str) -> dict[str, Any]:
    """The fields a result file starts with: the script, its commit, today's date, the device
    (the GPU's name, or CPU) and the Python and torch versions."""
    import torch

    return {"benchmark": benchmark, "commit": commit(), "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "triton": _triton()}}


def _triton() -> Optional[str]:
    """The Triton version (the kernels' compiler), or None where it is not installed."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def save_partial(result: dict[str, Any], out: Optional[Path]) -> None:
    """Write the rows measured so far to `out`, marked incomplete: a run cut off by its time limit
    keeps them, and the final `emit` rewrites the file whole."""
    if out:
        out.write_text(json.dumps({**result, "complete": False}, indent=2) + "\n")


def emit(result: dict[str, Any], out: Optional[Path]) -> dict[str, Any]:
    """Print the result as indented JSON, and write it to `out` when given; returns it."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")
    return result
