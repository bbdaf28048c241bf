"""`flashtrain rl`: tokenizer and policy in place, a Ray cluster, then the coordinator's loop.

The policy starts from `model.init_from` (an SFT checkpoint) or, by default, from the built-in
SFT run first into <run>/sft, so `flashtrain rl` works on a fresh machine. Metrics go to
<run>/metrics.jsonl and the tracker (W&B) with per-effort reward, accuracy and lengths.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from conf.errors import ConfigError


def builtin_sft_policy(cfg, run_dir: Path, sft_cfg) -> Path:
    """Run (or resume) the built-in SFT (`sft_cfg`, the sft stage's config with rl.sft_overrides)
    for this model and tokenizer; its newest checkpoint."""
    from trainer.checkpoint import CheckpointManager
    from trainer.sft import run_sft

    if sft_cfg is None:
        raise ConfigError("rl: no model.init_from, and no built-in SFT config to make one")
    sft_dir = run_dir / "sft"
    # the policy's architecture; the SFT's own starting weights, if rl.sft_overrides name any
    model = dataclasses.replace(cfg.model, init_from=sft_cfg.model.init_from)
    typed = dataclasses.replace(sft_cfg, model=model, data=cfg.data, logger=cfg.logger)
    ckpts = CheckpointManager(sft_dir / "checkpoints", 1, 0)
    done = ckpts.find_latest_valid()
    if done is None or _checkpoint_step(done.name) < typed.trainer.max_steps:
        print(f"flashtrain rl: no model.init_from given: running the built-in SFT into {sft_dir}", flush=True)
        run_sft(typed, sft_dir, OmegaConf.to_yaml(OmegaConf.structured(typed)))
        done = ckpts.find_latest_valid()
    return done


def initial_policy(cfg) -> str | None:
    """model.init_from: a checkpoint (resolved to the newest complete one) or a public-layout
    directory (the trainers import it); None: run the built-in SFT."""
    from trainer.init_weights import resolve_init_source

    if cfg.model.init_from is None:
        return None
    return str(resolve_init_source(cfg.model.init_from))


def actor_demand(rl, extra_actors: int = 0) -> dict[str, float]:
    """The Ray resources the RL actors hold at once: a CPU each, and their GPUs."""
    return {"CPU": float(rl.trainer_workers + rl.rollout_workers + rl.reward_workers + extra_actors),
            "GPU": rl.trainer_workers * rl.trainer_gpus + rl.rollout_workers * rl.rollout_gpus}


def resource_shortfall(have: dict[str, float], need: dict[str, float], rl,
                       extra_actors: int = 0) -> Optional[str]:
    """What the cluster `have` lacks for the actors, in one line (None: enough). Ray would leave
    the actors pending until a call's timeout, and that error names neither."""
    short = [f"{need[k]:g} {k}s but the cluster has {have.get(k, 0.0):g}" for k in ("CPU", "GPU")
             if need[k] > have.get(k, 0.0)]
    if not short:
        return None
    who = (f"{rl.trainer_workers} trainer, {rl.rollout_workers} rollout and {rl.reward_workers} reward actors"
           + (f" and {extra_actors} teacher workers" if extra_actors else ""))
    return f"rl: {who} need {' and '.join(short)} (rl.ray_num_cpus, the rl.*_workers counts, rl.*_gpus)"


def run_rl(cfg, run_dir: Path, config_yaml: str, builtin_sft=None, make_coordinator=None, console=None,
           extra_actors: int = 0) -> dict[str, Any]:
    """builtin_sft: the SFT config that makes the starting policy when model.init_from gives
    none (`launch.stages.rl.builtin_sft_config`); make_coordinator(cfg, run_dir,
    tokenizer_path, policy, log) (default rl.coordinator's), console(row) -> the line
    printed for a metrics row, extra_actors: Ray actors beyond the RL roles (flashtrain
    distill's teacher workers)."""
    import ray

    from data import build_datasets
    from data.chat import EFFORT_MAX
    from rl.algorithm import length_penalty_coef
    from rl.coordinator import Coordinator
    from rl.policy import check_policy_gradients
    from trainer.engine import check_trainer_counts
    from trainer.metrics import MetricsLog
    from trainer.tracking import build_tracker

    check_trainer_counts(cfg.trainer)  # before the built-in SFT, not when the trainer actors start after it
    check_policy_gradients(cfg.trainer, composite=False)  # dtype keys now; ZeRO-2 once the optimiser exists
    rl = cfg.rl
    try:  # the reward's settings, before any work rather than at the first scored sample
        length_penalty_coef(EFFORT_MAX, rl.length_penalty_base, rl.length_penalty_scale)
    except ValueError as e:
        raise ConfigError(f"rl.length_penalty_base/rl.length_penalty_scale: {e}") from None
    if rl.rollout_replay is not None and rl.rollout_replay < 1:
        raise ConfigError(f"rl.rollout_replay={rl.rollout_replay}: expected tokens >= 1, or null for no "
                          "CED prefill")
    need = actor_demand(rl, extra_actors)
    if rl.ray_address is None and rl.ray_num_cpus:  # a local cluster of that size: known before any work
        problem = resource_shortfall({"CPU": float(rl.ray_num_cpus), "GPU": float(torch.cuda.device_count())},
                                     need, rl, extra_actors)
        if problem:
            raise ConfigError(problem)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    _, _, tokenizer = build_datasets(cfg.data)  # the pretraining tokenizer (cached)
    tokenizer_path = run_dir / "tokenizer.json"
    tokenizer.save(tokenizer_path)
    policy = initial_policy(cfg)
    if policy is None:
        policy = str(builtin_sft_policy(cfg, run_dir, builtin_sft))

    needed = int(need["CPU"])
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=rl.ray_address,
                 num_cpus=None if rl.ray_address else (rl.ray_num_cpus or max(needed, os.cpu_count() or 1)),
                 include_dashboard=False, log_to_driver=True, configure_logging=False)
    problem = resource_shortfall(ray.cluster_resources(), need, rl, extra_actors)
    if problem and rl.ray_address is None:
        raise ConfigError(problem)
    if problem:  # an external cluster may still grow (autoscaling): say it, then wait as configured
        print(f"flashtrain: warning: {problem}; the actors wait up to rl.timeout_s={rl.timeout_s:g} s",
              flush=True)
    id_file = run_dir / "wandb_run_id"
    resuming = (run_dir / "checkpoints" / "latest").exists() and cfg.trainer.resume != "none"
    container = OmegaConf.to_container(OmegaConf.create(config_yaml), resolve=True)
    tracker = build_tracker(cfg.logger, run_dir, container,
                            id_file.read_text().strip() if resuming and id_file.exists() else None, 0)
    if tracker.run_id:
        id_file.write_text(tracker.run_id)
    latest = run_dir / "checkpoints" / "latest"
    metrics = MetricsLog(run_dir / "metrics.jsonl",
                         resume_step=_checkpoint_step(latest.read_text()) if resuming else None, enabled=True)
    if resuming:  # what a killed run logged but W&B never received
        tracker.restore(metrics.rows())

    def log(row: dict[str, Any]) -> None:
        metrics.write(row)
        tracker.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
        if console is not None:
            print(console(row), flush=True)
        elif "loss" in row:
            efforts = "  ".join(f"e{k.split('/')[0][7:]} len {v:.1f}" for k, v in row.items()
                                if k.endswith("/len_mean"))
            print(f"rl step {row['step']}: task_reward {row['task_reward']:.3f} reward {row['reward']:+.3f} "
                  f"samples/s {row['samples_per_s']:.2f} idle {row['trainer_idle_frac']:.2f}  {efforts}",
                  flush=True)
        else:
            print(f"rl eval at {row['step']}: "
                  + "  ".join(f"{k[5:]} {v:.3f}" for k, v in row.items() if k != "step"),
                  flush=True)

    coordinator = (make_coordinator or Coordinator)(cfg, run_dir, str(tokenizer_path), policy, log)
    try:
        summary = coordinator.run()
    finally:
        coordinator.shutdown()
        tracker.finish()
        if started_ray:
            ray.shutdown()
    summary["policy"] = policy
    return summary


def _checkpoint_step(tag: str) -> int:
    """step_00000100 -> 100 (trainer/checkpoint.py's tag format)."""
    from trainer.checkpoint import TAG_PREFIX
    return int(tag.strip()[len(TAG_PREFIX):])
