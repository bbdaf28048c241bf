"""How far the RL rollout engine's log-probs are from the policy's training forward, on the CPU.
RL's importance ratio is exp(training log-prob - rollout log-prob) per sampled token; any gap
that is not a policy update is train/inference mismatch. For each rollout setting and prompt
length: the per-token |gap| (mean, p99, max) and the ratio's spread and share outside the clip
range (rl.clip_low / rl.clip_high), sampling at temperature 1, top-p 1; and under greedy decoding,
the share of prompts whose continuation is token for token the one that repeated full forwards
pick.

Settings: `matched` is what rl/workers.py runs now (a quantised KV cache only under
model.kv_quant=qat; CED prefill past rl.rollout_replay tokens); `packed` stores FP4/FP8 KV for a
model trained without KV QAT (what rollouts did before); `no-replay` turns CED prefill off.

    python -m bench.experiments.rollout_consistency --run RUN_DIR [--lengths 64,512] \
        [--out bench/results/experiments/rollout-consistency-cpu.json]

RUN_DIR is a pretraining run (its config.yaml and checkpoints/), e.g. the Quickstart's; prompts
are slices of this repository's README, tokenized with the run's tokenizer.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from omegaconf import OmegaConf

from bench import provenance
from conf.rl import RLLoopConfig
from inference.generate import generate
from rl.policy import behaviour_logprobs, response_logprobs

REPO = Path(__file__).resolve().parents[2]


def load_policy(run: Path):
    """The run's model (its own config), its newest checkpoint's weights, and its tokenizer."""
    from data import build_datasets
    from launch.stages import all_stages
    from trainer.checkpoint import load_model_weights, resolve_checkpoint
    from trainer.pretrain import build_model

    stage = all_stages()["pretrain"].config
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(stage),
                                              OmegaConf.load(run / "config.yaml")))
    _, _, tok = build_datasets(cfg.data)
    model = build_model(cfg, tok)
    load_model_weights(model, resolve_checkpoint(run, "--run"))
    return model.eval(), tok, cfg


def gaps(model, prompts: list[list[int]], new_tokens: int, packed: bool, replay, seed: int) -> torch.Tensor:
    """Per sampled token: training log-prob - rollout log-prob [tokens]."""
    gens = generate(model, prompts, new_tokens, temperature=1.0, top_p=1.0, packed=packed, replay=replay,
                    seed=seed)
    samples = [{"prompt": p, "response": g.tokens, "behaviour": g.logprobs} for p, g in zip(prompts, gens)]
    with torch.no_grad():
        logp, mask = response_logprobs(model, samples, pad_id=0)
    return (logp - behaviour_logprobs(samples, logp))[mask].double()


@torch.no_grad()
def greedy_agreement(model, prompts: list[list[int]], new_tokens: int, packed: bool, replay) -> dict:
    """The engine's greedy continuation against argmax over repeated full forwards (no cache)."""
    gens = generate(model, prompts, new_tokens, temperature=0.0, packed=packed, replay=replay)
    same, first_diff = 0, []
    for prompt, g in zip(prompts, gens):
        ids = list(prompt)
        for _ in range(len(g.tokens)):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        want = ids[len(prompt):]
        same += want == g.tokens
        first_diff += [next((i for i, (a, b) in enumerate(zip(want, g.tokens)) if a != b), len(want))]
    return {"greedy_same": same / len(prompts),
            "greedy_first_difference_mean": sum(first_diff) / len(first_diff)}


def summary(gap: torch.Tensor, clip_low: float, clip_high: float) -> dict:
    ratio = gap.exp()
    q = torch.tensor([0.01, 0.99], dtype=torch.float64)
    return {"tokens": gap.numel(), "abs_gap_mean": float(gap.abs().mean()),
            "abs_gap_p99": float(gap.abs().quantile(0.99)), "abs_gap_max": float(gap.abs().max()),
            "ratio_p1_p99": [float(x) for x in ratio.quantile(q)],
            "ratio_outside_clip": float(((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).double().mean())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, required=True, help="a pretraining run directory")
    ap.add_argument("--lengths", default="64,512", help="prompt lengths in tokens")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok, cfg = load_policy(args.run)
    rl = RLLoopConfig()
    text = tok.encode((REPO / "README.md").read_text())
    qat = cfg.model.kv_quant == "qat"
    settings = {"matched": (qat, rl.rollout_replay), "packed": (True, rl.rollout_replay),
                "no-replay": (qat, None)}
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        step = max(1, (len(text) - length) // args.prompts)
        prompts = [[tok.bos_id, *text[i * step:i * step + length - 1]] for i in range(args.prompts)]
        for name, (packed, replay) in settings.items():
            gap = gaps(model, prompts, args.new_tokens, packed, replay, seed=length)
            rows.append({"prompt_tokens": length, "setting": name, "packed_cache": packed, "replay": replay,
                         **summary(gap, rl.clip_low, rl.clip_high),
                         **greedy_agreement(model, prompts, args.new_tokens, packed, replay)})
            print(rows[-1], flush=True)
    result = {**provenance.header("rollout_consistency"), "run": str(args.run), "model": cfg.model.name,
              "kv_quant": cfg.model.kv_quant, "clip": [rl.clip_low, rl.clip_high], "rows": rows}
    provenance.emit(result, args.out)


if __name__ == "__main__":
    main()
