"""Task synthesis (tasks/synthesis.py, rl/replay.py, rl/synthesis.py): strict parsing of proposed
triples, the sandbox filters against hand-written good and bad triples, the proposer rewards,
the synthesised-task source, the failed-case replay buffer (order, age, size, exact resume) and
the synthesis stage's counts on canned proposals."""
import dataclasses
import json
import random

import pytest

import tasks.synthesis as synthesis
from conf.synth import SynthSettings
from rl.replay import FailedCaseReplay
from tasks import Problem, load_task
from tasks.sandbox import SandboxResult
from tasks.synthesis import (
    ParseError,
    ProposeTasks,
    SynthesizedTasks,
    Triple,
    check_triple,
    difficulty_reward,
    parse_triple,
    proposer_reward,
    templated_triple,
)

GOOD = Triple("Write a Python function double(x) that returns 2 * x.", "def double(x):\n    return 2 * x\n",
              "assert double(3) == 6\nassert double(-1) == -2\n", "double")


def text(problem: str, solution: str, tests: str) -> str:
    return f"Problem: {problem}\nSolution:\n```python\n{solution}```\nTests:\n```python\n{tests}```\n"


def test_templated_triples_round_trip_through_the_parser():
    rng = random.Random(0)
    for _ in range(200):
        triple = templated_triple(rng)
        assert parse_triple(triple.text()) == triple
    assert parse_triple(GOOD.text()) == GOOD


@pytest.mark.parametrize("answer,reason", [
    (None, "not_text"), (12, "not_text"), ("", "layout"), ("Problem: x", "layout"),
    (GOOD.text() + "and more", "layout"),  # nothing may follow the tests
    (GOOD.text().replace("Tests:", "Test:"), "layout"),
    (text("", "def f(x):\n    return x\n", "assert f(1) == 1\n"), "layout"),
    (text("p" * 1001, "def f(x):\n    return x\n", "assert f(1) == 1\n"), "too_long"),
    (text("p", "def f(x:\n    return x\n", "assert f(1) == 1\n"), "solution_syntax"),
    (text("p", "def f(x):\n    return x\n", "assert f(1) ==\n"), "tests_syntax"),
    (text("p", "x = 1\n", "assert x == 1\n"), "no_function"),
    (text("p", "def f(x):\n    return x\n", "f(1)\n"), "no_assert"),
    (text("p", "def f(x):\n    return x\n", "assert 1 == 1\n"), "tests_skip_function"),
    (text("p", "\0", "assert f(1) == 1\n"), "solution_syntax"),
])
def test_malformed_proposals_are_parse_errors_with_a_reason(answer, reason):
    with pytest.raises(ParseError) as e:
        parse_triple(answer)
    assert e.value.reason == reason


def test_parse_takes_the_last_function_and_allows_helpers():
    solution = "def helper(x):\n    return x + 1\n\ndef f(x):\n    return helper(x) * 2\n"
    triple = parse_triple(text("p", solution, "assert f(1) == 4\n"))
    assert triple.function == "f"


def test_the_filters_keep_a_good_triple():
    verdict = check_triple(GOOD)
    assert verdict.valid and verdict.reason == "" and verdict.sandbox_s > 0
    for seed in range(3):
        assert check_triple(templated_triple(random.Random(seed))).valid


@pytest.mark.parametrize("solution,tests,failed,why", [
    # the reference fails its own tests: verifiable (same verdict twice), not solvable
    ("def f(x):\n    return x + 1\n", "assert f(1) == 3\n", "solvable", "reference fails"),
    # the reference never finishes: not verifiable
    ("def f(x):\n    while True:\n        pass\n", "assert f(1) == 2\n", "verifiable", "hit"),
    # tests a constant satisfies
    ("def f(x):\n    return 0\n", "assert f(1) == 0\nassert f(2) == 0\n", "nontrivial", "returning 0"),
    ("def f(x):\n    return None\n", "assert f(5) is None\n", "nontrivial", "returning None"),
    ("def f(s):\n    return ''\n", "assert f('ab') == ''\n", "nontrivial", "returning ''"),
    # every expected value is the same literal: a stub returning it passes
    ("def f(x):\n    return max(x, -2)\n", "assert f(-10) == -2\nassert f(-2) == -2\n", "nontrivial",
     "returning -2"),
    ("def f(s):\n    return s[:1]\n", "assert f('ab') == 'a'\nassert f('ac') == 'a'\n", "nontrivial",
     "returning 'a'"),
    ("def f(xs):\n    return xs[-1:]\n", "assert f([1, 2]) == [2]\nassert f([2]) == [2]\n", "nontrivial",
     "returning [2]"),
    # tests the identity satisfies
    ("def f(x):\n    return x\n", "assert f(3) == 3\nassert f(4) == 4\n", "nontrivial", "its argument"),
    # tests that pass whatever f returns (and without any f, they never call it)
    ("def f(x):\n    return 2 * x\n", "assert f(2) == f(2)\n", "nontrivial", "returning None"),
    ("def f(x):\n    return 2 * x\n", "if False:\n    assert f(2) == 4\n", "nontrivial", "no solution"),
    ("def f(x):\n    return 2 * x\n", "try:\n    assert f(2) == 4\nexcept BaseException:\n    pass\n",
     "nontrivial", "no solution"),
])
def test_each_filter_rejects_what_it_should(solution, tests, failed, why):
    verdict = check_triple(Triple("p", solution, tests, "f"), wall_s=3.0, cpu_s=1.0)
    assert not verdict.valid
    assert verdict.reason.startswith(failed) and why in verdict.reason
    order = list(synthesis.FILTERS)
    for name in order[:order.index(failed)]:  # every filter before the failing one passed
        assert getattr(verdict, name)


def test_a_verifier_that_changes_its_verdict_is_not_verifiable(monkeypatch):
    verdicts = iter([True, False])

    def flaky(source, tests, **limits):
        passed = next(verdicts)
        return SandboxResult(passed, "ok" if passed else "failed", 0 if passed else 1, "", "", 0.01)

    monkeypatch.setattr(synthesis, "run_python", flaky)
    verdict = check_triple(GOOD)
    assert not verdict.verifiable and "different verdicts" in verdict.reason


def test_a_trivial_check_that_does_not_report_rejects_the_triple():
    """Tests that end the interpreter under a stub leave no report: the triple is not kept."""
    tests = "import os\nif f(2) != 4:\n    os._exit(0)\nassert f(2) == 4\n"
    verdict = check_triple(Triple("p", "def f(x):\n    return 2 * x\n", tests, "f"))
    assert verdict.solvable and not verdict.nontrivial and "unverified" in verdict.reason


def test_difficulty_and_proposer_rewards():
    assert difficulty_reward(0.0) == difficulty_reward(1.0) == 0.0
    assert difficulty_reward(0.5) == 1.0 and difficulty_reward(0.25) == difficulty_reward(0.75) == 0.75
    assert proposer_reward(False, 0.5) == 0.0
    assert proposer_reward(True, 1.0) == proposer_reward(True, 0.0) == proposer_reward(True, None) == 0.5
    assert proposer_reward(True, 0.25, difficulty_weight=0.5) == 0.5 + 0.5 * 0.75
    assert proposer_reward(True, 0.5, difficulty_weight=1.0) == 1.0
    with pytest.raises(ValueError):
        difficulty_reward(1.5)
    with pytest.raises(ValueError):
        proposer_reward(True, 0.5, difficulty_weight=2.0)


def test_propose_task_rewards_valid_triples_and_teaches_the_format():
    task = load_task("synth_propose", solve_fraction=0.5)
    assert isinstance(task, ProposeTasks)
    kinds = set()
    for i in range(6):
        problem = task.sample(random.Random(i))
        kinds.add(problem.answer["kind"])
        assert task.verify(problem, task.answer_text(problem)) == 1.0  # the demonstration is valid
        assert task.verify(problem, "def nothing():\n    pass\n") == 0.0
    assert kinds == {"propose", "solve"}
    propose = next(p for i in range(20) if (p := task.sample(random.Random(i))).answer["kind"] == "propose")
    assert propose.prompt.startswith("Propose Python task")
    trivial = text("p", "def f(x):\n    return 0\n", "assert f(1) == 0\n")
    for bad in (trivial, "", None, "Problem: nothing else"):
        assert task.verify(propose, bad) == 0.0


def test_synthesised_tasks_from_a_pool_are_validated_by_the_sandbox(tmp_path):
    pool = tmp_path / "tasks.jsonl"
    rows = [{"problem": GOOD.problem, "solution": GOOD.solution, "tests": GOOD.tests, "function": "double"},
            {"problem": "never served", "solution": "", "tests": "assert False\n", "function": "g",
             "valid": False}]
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_task("synth", pool=str(pool))
    assert isinstance(task, SynthesizedTasks)
    problems = [task.sample(random.Random(i)) for i in range(5)]
    assert {p.prompt for p in problems} == {GOOD.problem}
    p = problems[0]
    assert task.verify(p, task.answer_text(p)) == 1.0
    assert task.verify(p, "```python\ndef double(x):\n    return x + x\n```") == 1.0
    assert task.verify(p, "def double(x):\n    return 2\n") == 0.0
    assert task.verify(p, "def double(x):\n    while True:\n        pass\n") == 0.0
    for bad in ("", None, 7, "\ud800"):
        assert task.verify(p, bad) == 0.0
    templated = SynthesizedTasks()  # no pool: the templated problems
    q = templated.sample(random.Random(3))
    assert templated.verify(q, templated.answer_text(q)) == 1.0


def test_bad_pools_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        SynthesizedTasks(pool=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "p"}) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        SynthesizedTasks(pool=str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no valid triple"):
        SynthesizedTasks(pool=str(empty))


# ------------------------------------------------------------------------------ replay
def problem(i: int) -> Problem:
    return Problem(f"p{i}", f"prompt {i}", i, "t", {"n": i})


def test_replay_serves_failed_cases_oldest_first_and_drops_solved_ones():
    replay = FailedCaseReplay(capacity=8, max_age=100, max_serves=5)
    replay.feedback(problem(1), [1.0, 0.0], version=0)  # partly solved: not a failed case
    for i in (2, 3, 4):
        replay.feedback(problem(i), [0.0, 0.0], version=i)
    replay.feedback(problem(2), [0.0], version=9)  # already queued: keeps its place
    assert len(replay) == 3
    assert [replay.take(10).id for _ in range(3)] == ["p2", "p3", "p4"]
    assert replay.take(10) is None
    replay.feedback(problem(3), [0.0, 0.0], version=10)  # failed again: back at the end
    replay.feedback(problem(2), [0.0, 1.0], version=10)  # solved: gone
    replay.feedback(problem(4), [0.0, 0.0], version=10)
    assert [replay.take(11).id for _ in range(2)] == ["p3", "p4"]
    assert replay.take(11) is None


def test_replay_bounds_age_size_and_serves():
    replay = FailedCaseReplay(capacity=2, max_age=3, max_serves=2)
    for i in range(3):
        replay.feedback(problem(i), [0.0], version=0)
    assert len(replay) == 2  # p0, the oldest, was evicted
    assert replay.take(3).id == "p1"  # age 3: still live
    assert replay.take(4) is None  # p2 is 4 versions old: expired
    replay.feedback(problem(1), [0.0], version=4)  # p1 failed again: keeps its first-failure version 0
    assert replay.take(4) is None  # ... so it is expired too
    fresh = FailedCaseReplay(capacity=4, max_age=100, max_serves=2)
    fresh.feedback(problem(7), [0.0], version=0)
    for _ in range(2):
        assert fresh.take(1).id == "p7"
        fresh.feedback(problem(7), [0.0], version=1)
    assert fresh.take(1) is None  # served twice: retired
    with pytest.raises(ValueError):
        FailedCaseReplay(capacity=0)


def test_replay_state_restores_exactly():
    rng = random.Random(0)
    replay = FailedCaseReplay(capacity=5, max_age=6, max_serves=3)

    def step(buffer, r, version):
        out = []
        for _ in range(3):
            i = r.randrange(12)
            buffer.feedback(problem(i), [float(r.random() < 0.3)], version)
            taken = buffer.take(version)
            out.append(None if taken is None else taken.id)
            if taken is not None and r.random() < 0.5:
                buffer.feedback(taken, [0.0], version)
        return out

    for v in range(5):
        step(replay, rng, v)
    state = json.loads(json.dumps(replay.state()))  # what the checkpoint stores
    restored = FailedCaseReplay(capacity=5, max_age=6, max_serves=3)
    restored.restore(state)
    rng_state = rng.getstate()
    rng_b = random.Random()
    rng_b.setstate(rng_state)
    assert [step(replay, rng, v) for v in range(5, 15)] == [step(restored, rng_b, v) for v in range(5, 15)]
    assert replay.state() == restored.state()


# ------------------------------------------------------------------------------ the stage
def test_the_stage_counts_filters_and_writes_the_pool(monkeypatch, tmp_path):
    """Canned proposals (valid, wrong reference, trivial, malformed, a duplicate) through
    rl.synthesis.synthesize with the real sandbox; the solver's canned answers set pass rates."""
    import rl.synthesis as stage

    valid = templated_triple(random.Random(1))
    proposals = [valid.text(), text("p", "def f(x):\n    return x + 1\n", "assert f(1) == 3\n"),
                 text("p", "def f(x):\n    return 0\n", "assert f(1) == 0\n"), "garbage", valid.text(),
                 GOOD.text()]
    # two attempts at each valid proposal (the duplicate too): pass rates 1/2, 1/2 and 1
    solver_answers = {valid.problem: [valid.solution, "def nope():\n    pass\n"] * 2,
                      GOOD.problem: [GOOD.solution, GOOD.solution]}

    class Chat:
        def prompt(self, user, effort):
            return user

    calls = []

    def fake_answers(model, chat, users, s, max_new_tokens, seed):
        calls.append(len(users))
        if len(calls) == 1:
            return proposals[:len(users)]
        seen: dict[str, int] = {}
        out = []
        for u in users:
            out.append(solver_answers[u][seen.get(u, 0)])
            seen[u] = seen.get(u, 0) + 1
        return out

    monkeypatch.setattr(stage, "_answers", fake_answers)
    settings = SynthSettings(proposals=6, attempts=2)
    rows, summary = stage.synthesize(None, Chat(), settings)
    assert summary["counts"] == {"proposed": 6, "parsed": 5, "verifiable": 5, "solvable": 4, "nontrivial": 3}
    assert summary["valid"] == 3 and summary["distinct_valid_problems"] == 2
    assert summary["parse_errors"] == {"layout": 1}
    assert summary["filter_failures"] == {"solvable": 1, "nontrivial": 1}
    assert summary["filter_reasons"] == {"solvable: the reference fails its tests": 1,
                                         "nontrivial: passed by a stub returning 0": 1}
    assert calls == [6, 3 * 2]  # every valid proposal was tried `attempts` times
    assert [r["pass_rate"] for r in rows if r["valid"]] == [0.5, 0.5, 1.0]
    assert [r["proposer_reward"] for r in rows] == [1.0, 0.0, 0.0, 0.0, 1.0, 0.5]
    stage.write_outputs(tmp_path, rows, summary)
    pool = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert [r["problem"] for r in pool] == [valid.problem, GOOD.problem]  # distinct problems only
    task = SynthesizedTasks(pool=str(tmp_path / "tasks.jsonl"))
    p = task.sample(random.Random(0))
    assert task.verify(p, task.answer_text(p)) == 1.0
    assert json.loads((tmp_path / "synthesis.json").read_text())["valid"] == 3
    assert len((tmp_path / "proposals.jsonl").read_text().splitlines()) == 6


# ------------------------------------------------------------------------------ RL end to end
@pytest.mark.slow
@pytest.mark.extended  # an SFT, an RL run on Ray and its resume
def test_rl_trains_on_a_synthesised_pool_with_failed_cases_replayed_and_resumes(flashtrain, tmp_path):
    """`flashtrain rl rl.task=synth` on a pool file, with replay: failed problems come back in
    later versions (replay_frac > 0), the buffer is in the checkpoint and a resume continues."""
    pool = tmp_path / "tasks.jsonl"
    rng = random.Random(0)
    pool.write_text("".join(json.dumps(dataclasses.asdict(templated_triple(rng))) + "\n" for _ in range(20)))
    run = tmp_path / "rl"
    fast = ["logger=none", "trainer.torch_threads=1", "rl.task=synth", f"+rl.task_kwargs={{pool:{pool}}}",
            "rl.replay_fraction=1.0", "rl.prompts_per_step=4", "rl.group_size=2", "rl.max_new_tokens=16",
            "rl.eval_prompts=2", "rl.eval_every=0", "rl.rollout_workers=1", "rl.prompts_per_request=2",
            "rl.timeout_s=120", "rl.efforts=[50]", "rl.effort_weights=[1.0]",
            "rl.sft_overrides=['trainer.max_steps=2','trainer.save_every=2','trainer.eval_every=0',"
            "'trainer.micro_batch_size=2','sft.builtin_samples=256','sft.builtin_task=synth','eval.problems=0']"]
    p = flashtrain("rl", *fast, "rl.steps=2", "rl.save_every=2", f"hydra.run.dir={run}", timeout=900)
    assert p.returncode == 0, p.stderr[-4000:] + p.stdout[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # an untrained solver fails every pool problem in 16 tokens: version 1's prompts all enter the
    # buffer, and with replay_fraction 1 every prompt admitted after that is one of them again
    assert steps[0]["task_reward"] == 0.0 and steps[0]["replay_frac"] == 0.0
    assert steps[1]["replay_frac"] == 1.0
    p = flashtrain("rl", *fast, "rl.steps=3", f"hydra.run.dir={run}", timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "resumed at version 2" in p.stdout
    steps = [r for r in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                         if line.strip()) if "loss" in r]
    # version 3 trains the prompts re-queued at the save: replays, restored from the checkpoint
    assert [r["step"] for r in steps] == [1, 2, 3] and steps[-1]["replay_frac"] == 1.0


@pytest.mark.slow
def test_the_synth_stage_runs_from_the_cli_and_rejects_bad_settings(flashtrain, tmp_path):
    """An untrained `tiny` writes no valid triple, but the stage runs end to end and says so."""
    run = tmp_path / "synth"
    p = flashtrain("synth", "synth.proposals=3", "synth.max_new_tokens=8", "synth.attempts=1",
                   f"hydra.run.dir={run}", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "3 proposed, 0 parsed" in p.stdout
    summary = json.loads((run / "synthesis.json").read_text())
    assert summary["counts"]["proposed"] == 3 and summary["valid"] == 0
    assert sum(summary["parse_errors"].values()) == 3
    assert len((run / "proposals.jsonl").read_text().splitlines()) == 3
    assert (run / "tasks.jsonl").read_text() == ""
    p = flashtrain("synth", "synth.proposals=0", f"hydra.run.dir={tmp_path / 'bad'}", timeout=300)
    assert p.returncode == 2 and "synth" in p.stderr and "proposals" in p.stderr
