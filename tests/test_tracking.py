"""W&B after a kill: the rows a killed run wrote to metrics.jsonl but W&B never received are logged
again when the run resumes, and nothing W&B already holds is sent twice. W&B itself is replaced
by a recording stand-in whose history plays the part of W&B's server."""
import json
import sys
import types

import pytest

from conf.logger import LoggerConfig
from trainer.metrics import MetricsLog
from trainer.tracking import WandbTracker


class _History:
    """W&B's view of one run: the rows it accepted, and the step its resume starts from."""

    def __init__(self):
        self.rows: list[tuple[int, dict]] = []
        self.next_resume_step = 0


class _Run:
    def __init__(self, history: _History, run_id: str):
        self.id, self.history = run_id, history
        self.step = history.next_resume_step

    def log(self, row, step):
        assert step >= self.step, f"W&B drops a row at step {step} below its step {self.step}"
        self.history.rows.append((step, dict(row)))
        self.step = step

    def finish(self):
        pass


@pytest.fixture
def wandb_history(monkeypatch):
    history = _History()
    fake = types.SimpleNamespace(init=lambda **kw: _Run(history, kw.get("id") or "run0"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return history


def _write(metrics: MetricsLog, steps):
    for s in steps:
        metrics.write({"step": s, "loss": 10.0 - s})
        if s % 2 == 0:
            metrics.write({"step": s, "val_loss": 20.0 - s})


def _tracker(tmp_path, run_id=None):
    return WandbTracker(LoggerConfig(name="wandb", mode="offline"), tmp_path, {}, run_id)


def test_resume_restores_the_rows_wandb_lost_in_a_kill(tmp_path, wandb_history):
    path = tmp_path / "metrics.jsonl"
    first = MetricsLog(path, None, True)
    tracker = _tracker(tmp_path)
    _write(first, range(1, 5))  # the killed segment: rows 1..4 on file (with val rows at 2 and 4)
    for row in first.rows()[:1]:  # ... but only step 1 reached W&B before the kill
        tracker.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    wandb_history.next_resume_step = 2
    _write(first, range(5, 7))  # steps past the checkpoint (4): redone by the resumed run

    resumed = MetricsLog(path, 4, True)
    again = _tracker(tmp_path, tracker.run_id)
    assert again.restore(resumed.rows()) == 5  # steps 2, 2 (val), 3, 4, 4 (val)
    _write(resumed, range(5, 7))
    for row in resumed.rows()[-3:]:
        again.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    on_file = [(r["step"], {k: v for k, v in r.items() if k != "step"})
               for r in map(json.loads, path.read_text().splitlines())]
    assert wandb_history.rows == on_file  # W&B holds every row of the file, once, in order


def test_rows_wandb_already_holds_are_not_sent_again(tmp_path, wandb_history):
    """The killed run got past its checkpoint in W&B too (steps 5 and 6 of a checkpoint at 4):
    the resumed run's steps 5 and 6 are the same values and are not sent again."""
    path = tmp_path / "metrics.jsonl"
    first = MetricsLog(path, None, True)
    _write(first, range(1, 7))
    wandb_history.rows = [(s, {}) for s in range(1, 7)]
    wandb_history.next_resume_step = 7
    resumed = MetricsLog(path, 4, True)
    again = _tracker(tmp_path, "run0")
    assert again.restore(resumed.rows()) == 0
    for step in (5, 6, 7):
        again.log({"loss": 1.0}, step=step)
    assert [s for s, _ in wandb_history.rows] == [1, 2, 3, 4, 5, 6, 7]


def test_lists_stay_out_of_wandb(tmp_path, wandb_history):
    """An RL row's prompt ids are for metrics.jsonl (an audit of what trained); W&B gets numbers."""
    _tracker(tmp_path).log({"loss": 1.0, "prompt_ids": [3, 1]}, step=1)
    assert wandb_history.rows == [(1, {"loss": 1.0})]
