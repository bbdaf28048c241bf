"""The chaos suite (`pytest -m chaos`) as a table: each case, its outcome and its time.

    python -m bench.system.chaos_suite [--out FILE] [-- extra pytest args]

Runs the tests marked `chaos` in one pytest process and prints one JSON object: per test, the
outcome (passed / failed / skipped, with the reason) and seconds, plus the totals. Every case
asserts its own "nothing lost, nothing duplicated, no hang" condition; the kill -9 soak with its
per-trial detail is `bench/system/chaos_kill.py`.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from bench import provenance

REPO = Path(__file__).resolve().parents[2]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        env = dict(os.environ, WANDB_MODE="offline", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        run = subprocess.run([sys.executable, "-m", "pytest", "-m", "chaos", "-q", "-p", "no:cacheprovider",
                              f"--junitxml={report}", *args.pytest_args], cwd=REPO, env=env)
        cases = []
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome, reason = "passed", ""
            for tag in ("failure", "error", "skipped"):
                found = case.find(tag)
                if found is not None:
                    outcome, reason = (("skipped" if tag == "skipped" else "failed"),
                                       found.get("message", "")[:200])
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                          "seconds": round(float(case.get("time", 0)), 1),
                          **({"reason": reason} if reason else {})})
    out = {**provenance.header("bench/system/chaos_suite.py"), "pytest_exit": run.returncode,
           "cases": cases, "passed": sum(c["outcome"] == "passed" for c in cases),
           "failed": sum(c["outcome"] == "failed" for c in cases),
           "skipped": sum(c["outcome"] == "skipped" for c in cases)}
    return provenance.emit(out, args.out)


if __name__ == "__main__":
    main()
