"""bench/'s scripts find the repository from their own path: after a script moves into a
sub-folder, `parents[N]` must still name the root (the scripts run the CLI and pytest there)."""
import re

from tests.conftest import REPO

ROOT_FROM_FILE = re.compile(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d+)\]")


def test_every_script_that_locates_the_repository_finds_its_root():
    found = 0
    for script in sorted((REPO / "bench").rglob("*.py")):
        for depth in ROOT_FROM_FILE.findall(script.read_text()):
            found += 1
            root = script.resolve().parents[int(depth)]
            where = script.relative_to(REPO)
            assert (root / "pyproject.toml").is_file(), f"{where}: parents[{depth}] is {root}"
    assert found >= 5  # provenance.py, the chaos and EP drivers, distillation, the residual experiment
