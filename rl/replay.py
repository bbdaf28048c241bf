"""A replay buffer of failed cases (SPEC §10: failed cases replayed): problems the solver failed
are served again later, a bounded number of times within a bounded age. rl/prompts.py draws
from it (rl.replay_fraction) and the coordinator feeds it each trained group's rewards; its
state goes into the RL checkpoint, so a resume serves exactly what the run would have."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Optional

from tasks.base import Problem


@dataclass
class _Entry:
    problem: dict  # Problem as a dict
    added: int  # policy version of its first failure
    serves: int = 0  # times re-served


@dataclass
class FailedCaseReplay:
    """Problems the solver failed (every sample of its group scored 0), re-served oldest first.
    Bounded: at most `capacity` entries (the oldest go first), none older than `max_age` policy
    versions since its first failure, none served more than `max_serves` times. A served entry
    waits in `out` until its group is scored: failed again, it goes back to the end with its
    first-failure version; solved, it leaves. `state()` / `restore()` make a resume exact."""
    capacity: int = 256
    max_age: int = 20
    max_serves: int = 2
    entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    out: dict[str, _Entry] = field(default_factory=dict)

    def __post_init__(self):
        if self.capacity < 1 or self.max_age < 0 or self.max_serves < 1:
            raise ValueError(f"replay: need capacity >= 1, max_age >= 0, max_serves >= 1; got "
                             f"{self.capacity}, {self.max_age}, {self.max_serves}")

    def __len__(self) -> int:
        return len(self.entries)

    def take(self, version: int) -> Optional[Problem]:
        """The oldest live entry's problem (None when empty), after dropping expired ones."""
        self._expire(version)
        if not self.entries:
            return None
        pid, entry = self.entries.popitem(last=False)
        entry.serves += 1
        self.out[pid] = entry
        return Problem(**entry.problem)

    def feedback(self, problem: Problem, rewards: list[float], version: int) -> None:
        """A scored group: every reward 0 means failed."""
        served = self.out.pop(problem.id, None)
        if any(r > 0 for r in rewards):
            return
        if served is None:
            if problem.id not in self.entries:
                self.entries[problem.id] = _Entry(asdict(problem), version)
        elif served.serves < self.max_serves:
            self.entries[problem.id] = served
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def _expire(self, version: int) -> None:
        for pid in [pid for pid, e in self.entries.items() if version - e.added > self.max_age]:
            del self.entries[pid]

    def state(self) -> dict:
        return {"entries": [[pid, asdict(e)] for pid, e in self.entries.items()],
                "out": [[pid, asdict(e)] for pid, e in self.out.items()]}

    def restore(self, state: dict) -> None:
        self.entries = OrderedDict((pid, _Entry(**e)) for pid, e in state["entries"])
        self.out = {pid: _Entry(**e) for pid, e in state["out"]}
