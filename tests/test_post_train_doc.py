"""docs/post-train-released-model.md: its four commands (import, SFT, RL, export), run as the page
writes them, on a `tiny` stand-in for the released model."""
import json
import random
import re

import pytest

from tests.conftest import FAST, REPO

pytest.importorskip("ray")

DOC = REPO / "docs" / "post-train-released-model.md"
RELEASE, EXPORT = "/data/DeepSeek-V4.1-Flash", "/data/my-flash"


def doc_commands() -> list[str]:
    """The `flashtrain` lines of the first bash block under "## The commands"."""
    text = DOC.read_text()
    block = re.search(r"## The commands\n.*?```bash\n(.*?)```", text, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.startswith("flashtrain ")]


def test_the_page_has_the_four_steps():
    stages = [(c.split()[1], next(a.split("=")[0] for a in c.split()[2:] if a.split("=")[0] in
                                  ("import", "export", "model.init_from")))
              for c in doc_commands()]
    assert stages == [("convert", "import"), ("sft", "model.init_from"), ("rl", "model.init_from"),
                      ("convert", "export")]


@pytest.mark.slow
# ~28 s: in the extended tier; each stage keeps its own default tests (convert, sft, rl), and the
# page's four commands are checked above
@pytest.mark.extended
def test_the_post_training_walkthrough_runs_as_written(flashtrain, tmp_path):
    rng = random.Random(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for d in range(12):
        lines = [f"{a} + {b} = {a + b}. What is {a} plus {b}? The answer is {a + b}."
                 for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(120))]
        (corpus / f"doc{d}.txt").write_text("\n".join(lines))
    data = ["data=files", f"data.path={corpus}", "data.vocab_size=512", "data.val_fraction=0.1"]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": f"{a + b}", "reasoning": f"{a} + {b} = {a + b}"}],
        "effort": 50}) + "\n"
        for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(200))))

    # the stand-in release: a tiny model pretrained for a few steps, in the public layout
    pre = tmp_path / "pre"
    p = flashtrain("pretrain", *FAST, *data, "trainer.max_steps=2", "trainer.torch_threads=1",
                   f"hydra.run.dir={pre}")
    assert p.returncode == 0, p.stderr[-3000:]
    release = tmp_path / "release"
    p = flashtrain("convert", "model=tiny", f"export={release}", f"checkpoint={pre}",
                   f"hydra.run.dir={tmp_path / 'e'}", cache=False)
    assert p.returncode == 0, p.stderr[-3000:]

    # what a tiny stand-in needs on top of each step as written: its data and a few steps of it
    extra = {
        "convert": [],
        "sft": [*FAST, *data, "trainer.torch_threads=1", "trainer.max_steps=2", "sft.seq_len=128",
                "eval.problems=1", "eval.max_new_tokens=8"],
        "rl": [*data, "logger=none", "trainer.torch_threads=1", "rl.steps=1", "rl.prompts_per_step=2",
               "rl.group_size=2", "rl.max_new_tokens=8", "rl.eval_prompts=2", "rl.eval_every=0",
               "rl.rollout_workers=1", "rl.prompts_per_request=2", "rl.timeout_s=120"],
    }
    for command in doc_commands():
        args = []
        for a in command.split()[1:]:
            a = a.replace("model=flash", "model=tiny").replace(RELEASE, str(release)).replace(
                EXPORT, str(tmp_path / "out"))
            a = a.replace("=runs/", f"={tmp_path}/runs/").replace("=chats.jsonl", f"={chats}")
            args.append(a)
        p = flashtrain(*args, *extra[args[0]], timeout=900, cache=args[0] != "convert")
        assert p.returncode == 0, f"{command}\n{p.stderr[-3000:]}\n{p.stdout[-1500:]}"

    out = tmp_path / "out"
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= {
        f.name for f in out.iterdir()}
    # the RL policy's checkpoints name the import's public folder as their origin, through SFT
    rl_ckpt = sorted((tmp_path / "runs" / "rl" / "checkpoints").glob("step_*"))[-1]
    origin = json.loads((rl_ckpt / "origin.json").read_text())["origin"]
    assert origin == str(
        (tmp_path / "runs" / "released" / "checkpoints" / "step_00000000" / "public").resolve())
    assert json.loads((out / "config.json").read_text()) == {
        **json.loads((release / "config.json").read_text())}  # the same model, the same public config
