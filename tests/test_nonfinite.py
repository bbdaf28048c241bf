"""A step whose loss is NaN/Inf: its update is skipped (parameters, optimizer state and the
learning-rate schedule stay), the next finite step updates as usual, and a run of them stops."""
import subprocess
import sys

import pytest

from conf.errors import RunFailure
from tests.conftest import REPO, cli_env
from trainer.nonfinite import NonFiniteSteps

# One DeepSpeed engine per optimizer path the trainer uses: a client optimizer the engine drives as
# it is (ZeRO-0: Muon/Sinkhorn and expert parallelism take this path) and DeepSpeed's ZeRO-1
# optimizer, which must skip the step itself. Step 2's loss is NaN.
ENGINE_STEPS = r"""
import sys, torch, deepspeed
from trainer.nonfinite import boundary_step
stage = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config={
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": stage}, "steps_per_print": 2**31 - 1})
x = torch.randn(2, 8)
for step in (1, 2, 3):
    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = engine(x).square().mean() * (float("nan") if step == 2 else 1.0)
    engine.backward(loss)
    boundary_step(engine, opt, not torch.isfinite(loss).item(), step)
    moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))
    finite = all(torch.isfinite(p).all().item() for p in engine.module.parameters())
    print(step, int(engine.optimizer is opt), engine.skipped_steps, int(moved), int(finite), sched.last_epoch)
"""


@pytest.mark.parametrize("stage", [0, 1], ids=["client-optimizer", "deepspeed-zero1"])
def test_a_nan_step_leaves_weights_and_schedule_and_the_next_step_updates(port_base, stage):
    p = subprocess.run([sys.executable, "-c", ENGINE_STEPS, str(stage)], cwd=REPO, env=cli_env(port_base()),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [tuple(map(int, ln.split())) for ln in p.stdout.splitlines() if ln[:1].isdigit()]
    driven_as_is = 1 if stage == 0 else 0
    # step, engine drives the client optimizer, skipped so far, parameters moved, finite, schedule position
    assert rows == [(1, driven_as_is, 0, 1, 1, 1), (2, driven_as_is, 1, 0, 1, 1),
                    (3, driven_as_is, 1, 1, 1, 2)]


def test_skipped_steps_in_a_row_stop_the_run_and_a_finite_one_resets_the_count(capsys):
    steps = NonFiniteSteps(limit=3, is_main=True)
    for step, skipped in ((1, False), (2, True), (3, True), (4, False), (5, True), (6, True)):
        steps.record(step, skipped, "loss nan")
    assert (steps.in_a_row, steps.total) == (2, 4)
    assert capsys.readouterr().err.count("its update was skipped") == 4
    with pytest.raises(RunFailure,
                       match=r"step 7: loss nan, for 3 steps in a row \(trainer.max_nonfinite_steps=3\)"):
        steps.record(7, True, "loss nan")
    unlimited = NonFiniteSteps(limit=0, is_main=False)
    for step in range(100):
        unlimited.record(step, True, "loss nan")
    assert unlimited.total == 100
