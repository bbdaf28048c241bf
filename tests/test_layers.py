"""The top-level packages import one way (pyproject.toml [tool.importlinter]): launch > rl > trainer >
inference > model | optim | data > tasks > conf, function-level imports included; and inside model/
nothing imports in a circle (the reference modules never import a kernel: model/ops.py does)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_top_level_packages_import_one_way():
    lint = Path(sys.executable).parent / "lint-imports"
    p = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "2 kept, 0 broken" in p.stdout
