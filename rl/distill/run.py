"""`flashtrain distill`: the teacher registry checked, then the RL driver (rl/run.py: tokenizer,
student policy, Ray, metrics, tracker) with the distillation coordinator."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


def distill_rl_config(cfg, routes: dict[str, str]):
    """cfg with rl.task set to the mixture of the registry's domains (what the reward worker
    verifies and the prompt source draws from). With a KL term the student learns from its
    teachers even when every group's rewards are equal, so RL's "nothing is learned" warning
    (rl.flat_reward_warn_steps) is off."""
    tasks = {domain: cfg.distill.domains[domain].task for domain in routes}
    rl = dataclasses.replace(cfg.rl, task="tasks.distill_domains:DomainMixture",
                             task_kwargs={"domains": tasks},
                             flat_reward_warn_steps=(0 if cfg.distill.kl_weight > 0
                                                     else cfg.rl.flat_reward_warn_steps))
    return dataclasses.replace(cfg, rl=rl)


def console_line(row: dict[str, Any]) -> str:
    if "loss" in row:
        return (f"distill step {row['step']}: kl {row['kl']:.4f} task_reward {row['task_reward']:.3f} "
                f"domains {row['domains_in_batch']} samples/s {row['samples_per_s']:.2f} "
                f"teacher tok/s {row['teacher_tokens_per_s']:.0f} swap_s {row['teacher_swap_s']:.1f}")
    means = "  ".join(f"{k[5:]} {v:.4f}" for k, v in row.items() if k.startswith("eval/mean_"))
    return f"distill eval at {row['step']}: {means}"


def run_distill(cfg, run_dir: Path, config_yaml: str, builtin_sft=None) -> dict[str, Any]:
    from conf.distill import KL_MEANS
    from conf.errors import ConfigError
    from data.tokenizer import TextTokenizer
    from rl.distill.coordinator import DistillCoordinator
    from rl.distill.teachers import resolve_teachers
    from rl.run import run_rl

    if cfg.distill.kl_mean not in KL_MEANS:
        raise ConfigError(f"distill.kl_mean={cfg.distill.kl_mean!r}: expected one of {', '.join(KL_MEANS)}")
    teachers = resolve_teachers(cfg.distill)  # a missing teacher is named before anything starts
    cfg = distill_rl_config(cfg, teachers[0])

    def make(cfg_, run_dir_, tokenizer_path, policy, log):
        vocab = cfg_.model.vocab_size or TextTokenizer.from_file(tokenizer_path).vocab_size
        return DistillCoordinator(cfg_, run_dir_, tokenizer_path, policy, log, vocab, teachers)

    return run_rl(cfg, run_dir, config_yaml, builtin_sft, make_coordinator=make, console=console_line,
                  extra_actors=cfg.distill.teacher_workers)
