"""The RL trainer: the policy in a DeepSpeed engine, one process per data-parallel rank (a Ray
actor each; rl/coordinator.py starts them with RANK / WORLD_SIZE / MASTER_* set). Every call
that the coordinator makes is collective: each rank gets its share of the same batch.

A sample here is a dict: prompt (ids), response (ids), behaviour (the engine's per-token
log-probs), version (the policy version that generated it), advantage, effort.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from conf.errors import ConfigError
from rl.algorithm import policy_loss, stale_mask


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def response_logprobs(model, samples: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs under `model` of each sample's response tokens -> (logp [N, R], mask [N, R]),
    R the longest response; prompt and response go through one forward, right-padded."""
    seqs = [s["prompt"] + s["response"] for s in samples]
    ids = _pad(seqs, pad_id).to(next(model.parameters()).device)
    logits = model(ids[:, :-1]).logits.float()  # [N, L-1, V]: position i predicts token i+1
    logp_all = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]  # [N, L-1]
    R = max(len(s["response"]) for s in samples)
    logp = logp_all.new_zeros(len(samples), R)
    mask = torch.zeros(len(samples), R, dtype=torch.bool, device=logp.device)
    for i, s in enumerate(samples):
        p, r = len(s["prompt"]), len(s["response"])
        logp[i, :r] = logp_all[i, p - 1:p - 1 + r]
        mask[i, :r] = True
    return logp, mask


def behaviour_logprobs(samples: list[dict], like: torch.Tensor) -> torch.Tensor:
    """Each sample's rollout log-probs ("behaviour") laid out as response_logprobs lays out the
    training forward's: [N, R] like `like` (its dtype and device), zero past a response."""
    behaviour = torch.zeros(like.shape, dtype=like.dtype)
    for i, s in enumerate(samples):
        behaviour[i, :len(s["behaviour"])] = torch.tensor(s["behaviour"], dtype=like.dtype)
    return behaviour.to(like.device)



def check_policy_gradients(tc, composite: bool) -> None:
    """ConfigError for trainer keys the RL/distillation policy does not implement: it holds fp32
    weights and all-reduces whole fp32 gradients, so the pretraining trainer's ZeRO-2, bf16 gradient
    buffers and owner-held masters are not wired here."""
    if (composite and tc.zero_stage == 2) or tc.grad_accum_dtype != "fp32" or tc.param_dtype != "fp32":
        raise ConfigError(f"trainer.zero_stage={tc.zero_stage}, "
                          f"trainer.grad_accum_dtype={tc.grad_accum_dtype}, "
                          f"trainer.param_dtype={tc.param_dtype} "
                          "in the RL/distillation policy: it holds fp32 weights and all-reduces whole fp32 "
                          "gradients; use zero_stage=1, "
                          "grad_accum_dtype=fp32, param_dtype=fp32")


class PolicyTrainer:
    def __init__(self, cfg, tokenizer_path: str, policy: Optional[str], run_dir: str, env: dict[str, str]):
        os.environ.update(env)  # this rank's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
        from data.tokenizer import TextTokenizer
        from optim import CompositeOptimizer, build_optimizer, lr_multiplier
        from trainer.checkpoint import CheckpointManager
        from trainer.distributed import init_distributed
        from trainer.engine import build_engine, resolve_precision
        from trainer.fp8 import apply_fp8, check_fp8
        from trainer.init_weights import checkpoint_attachments, load_init_weights
        from trainer.pretrain import build_model, seed_everything

        if cfg.trainer.torch_threads:
            torch.set_num_threads(cfg.trainer.torch_threads)
        self.cfg, self.rl = cfg, cfg.rl
        self.config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        self.dist = init_distributed(cfg.trainer.collective_timeout_s)
        seed_everything(cfg.trainer.seed)
        self.tokenizer = TextTokenizer.from_file(tokenizer_path)
        tc = cfg.trainer
        check_fp8(tc.fp8, tc.fp8_emulate, resolve_precision(tc, self.dist.device), tc.zero_stage,
                  self.dist.device)
        self.model = build_model(cfg, self.tokenizer)
        apply_fp8(self.model, tc.fp8, tc.fp8_emulate)  # the policy's matmuls; rollout workers keep theirs
        weights_from = None
        if policy:  # a checkpoint or a public-layout directory (rl/run.py's initial_policy)
            weights_from = load_init_weights(self.model, policy)
        self.optimizer = build_optimizer(self.model, cfg.optim, cfg.trainer.zero_stage, self.dist.rank,
                                         self.dist.world_size, verbose=False)
        self.own_optimizer_state = isinstance(self.optimizer, CompositeOptimizer)
        check_policy_gradients(tc, self.own_optimizer_state)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(
            cfg.optim, self.rl.steps * self.rl.ppo_epochs * self.rl.minibatches))
        self.engine, _ = build_engine(self.model, self.optimizer, self.scheduler, cfg.trainer, self.dist,
                                      whole_param_optimizer=self.own_optimizer_state)
        self.ckpts = CheckpointManager(Path(run_dir) / "checkpoints", cfg.trainer.keep_last, self.dist.rank)
        self.ckpts.attachments = checkpoint_attachments(self.tokenizer, weights_from)
        self.version = 0  # optimizer steps taken: the version of the current weights
        from trainer.nonfinite import NonFiniteSteps
        self.nonfinite = NonFiniteSteps(cfg.trainer.max_nonfinite_steps, self.dist.is_main)
        self.distill = getattr(cfg, "distill", None)  # `flashtrain distill`: the reverse KL to teachers
        self.teacher_heads: dict[str, torch.Tensor] = {}  # teacher key -> LM head, sent once per teacher

    # ------------------------------------------------------------------ weights out
    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, a CPU copy of the model's state dict) for the rollout workers."""
        return self.version, {k: v.detach().to("cpu", copy=True)
                              for k, v in self.engine.module.state_dict().items()}

    # ------------------------------------------------------------------ one update
    def train_step(self, samples: list[dict],
                   heads: Optional[dict[str, torch.Tensor]] = None) -> dict[str, Any]:
        """One policy version from this rank's share of the batch (all ranks get the same list):
        rl.ppo_epochs x rl.minibatches optimizer steps.
        Tokens more than rl.max_staleness versions old are masked out of the loss. Distillation
        (cfg.distill): the reverse KL to each sample's teacher, `heads` the teacher LM heads
        not sent before."""
        start = time.perf_counter()
        rl, d = self.rl, self.dist
        mine = samples[d.rank::d.world_size]
        fresh = stale_mask(torch.tensor([s["version"] for s in mine]), self.version, rl.max_staleness)
        self.engine.train()
        if self.distill is not None:
            return self._distill_step(mine, fresh, heads, start)
        behaviour_kl, stats_sum, loss_sum, updates = 0.0, {}, 0.0, 0
        # PPO-style reuse of one batch: rl.ppo_epochs passes, each split into rl.minibatches
        # optimizer steps. The ratio is always to the rollout's own log-probs, so its clip and
        # truncation bound how far the later steps move from the policy that sampled.
        order = torch.randperm(len(mine), generator=torch.Generator().manual_seed(self.version))
        parts = [order[i::rl.minibatches].tolist() for i in range(rl.minibatches)]  # same count on every rank
        for epoch in range(self.rl.ppo_epochs):
            for part in parts:
                batch = [mine[i] for i in part]
                loss, stats, kl = self._policy_update(batch, fresh[part])
                if epoch == 0:  # the first pass sees the rollout's weights: its KL is the behaviour gap
                    behaviour_kl += kl * len(part) / len(mine)
                loss_sum += loss
                for k, v in stats.items():
                    stats_sum[k] = stats_sum.get(k, 0.0) + v
                updates += 1
        stats = {k: v / updates for k, v in stats_sum.items()}
        self.version += 1
        took = time.perf_counter() - start
        stale = [len(s["response"]) for s, ok in zip(mine, fresh.tolist()) if not ok]
        return {"loss": loss_sum / updates, **stats, "behaviour_kl": behaviour_kl, "version": self.version,
                "updates": updates, "train_s": took, "stale_samples": len(stale), "stale_tokens": sum(stale),
                "stale_lengths": stale,
                "trained_tokens": sum(len(s["response"]) for s, ok in zip(mine, fresh.tolist()) if ok)}

    def _policy_update(self, batch: list[dict], fresh: torch.Tensor) -> tuple[float, dict[str, float], float]:
        """One optimizer step of the clipped surrogate on `batch` -> (loss, stats,
        KL(behaviour || policy))."""
        rl = self.rl
        logp, mask = response_logprobs(self.engine, batch, self.tokenizer.pad_id)
        behaviour = behaviour_logprobs(batch, logp)
        mask = mask & fresh.to(mask.device)[:, None]
        adv = torch.tensor([s["advantage"] for s in batch], dtype=logp.dtype, device=logp.device)
        loss, stats = policy_loss(logp, behaviour, adv, mask, rl.clip_low, rl.clip_high, rl.is_cap)
        # the loss is a token mean on this rank; ranks see similar token counts, so the
        # engine's gradient mean over ranks is the batch token mean up to that imbalance
        self.engine.backward(loss)
        if self.own_optimizer_state:
            self._reduce_and_clip()
        self._step(loss)
        with torch.no_grad():
            kl = ((behaviour - logp.detach()) * mask).sum() / mask.sum().clamp(min=1)
        return float(loss.detach()), stats, float(kl)

    def _distill_step(self, mine: list[dict], fresh: torch.Tensor, heads, start: float) -> dict[str, Any]:
        from rl.distill.student import distill_objective, fetch_teacher_outputs

        self.teacher_heads.update(heads or {})
        fetch_teacher_outputs(mine, self.teacher_heads)
        loss, stats = distill_objective(self.engine.module, mine, fresh, self.teacher_heads,
                                        self.tokenizer.pad_id, self.distill, self.rl)
        self.engine.backward(loss)
        if self.own_optimizer_state:
            self._reduce_and_clip()
        self._step(loss)
        self.version += 1
        stale = [len(s["response"]) for s, ok in zip(mine, fresh.tolist()) if not ok]
        return {"loss": float(loss.detach()), **stats, "version": self.version,
                "train_s": time.perf_counter() - start,
                "stale_samples": len(stale), "stale_tokens": sum(stale), "stale_lengths": stale,
                "trained_tokens": sum(len(s["response"]) for s, ok in zip(mine, fresh.tolist()) if ok)}

    def _step(self, loss: torch.Tensor) -> None:
        """engine.step(), without its update when the loss is not finite on some rank (the
        pretraining trainer's rule, trainer/nonfinite.py): the version still advances."""
        from trainer.nonfinite import boundary_step

        skipped = boundary_step(self.engine, self.optimizer, not torch.isfinite(loss.detach()).all().item(),
                                self.version + 1)
        self.nonfinite.record(self.version + 1, skipped, f"policy loss {float(loss.detach()):g}")

    @torch.no_grad()
    def kl_eval(self, samples: list[dict],
                heads: Optional[dict[str, torch.Tensor]] = None) -> dict[str, list[float]]:
        """Reverse KL to the teachers on `samples` without an update: {domain: [KL sum, tokens]}."""
        from rl.distill.student import distill_objective, fetch_teacher_outputs

        self.teacher_heads.update(heads or {})
        fetch_teacher_outputs(samples, self.teacher_heads)
        self.engine.eval()
        fresh = torch.ones(len(samples), dtype=torch.bool)
        kl_only = dataclasses.replace(self.distill, kl_weight=1.0, reward_weight=0.0)
        _, stats = distill_objective(self.engine.module, samples, fresh, self.teacher_heads,
                                     self.tokenizer.pad_id, kl_only, self.rl)
        return stats["kl_by_domain"]

    def _reduce_and_clip(self) -> None:
        """Muon / Sinkhorn composite: whole-parameter gradients, averaged and clipped here."""
        import torch.distributed as dist

        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if dist.is_initialized() and self.dist.world_size > 1:
            for g in grads:
                dist.all_reduce(g)
                g /= self.dist.world_size
        if self.cfg.trainer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.engine.module.parameters(), self.cfg.trainer.grad_clip)

    # ------------------------------------------------------------------ checkpoints
    def save(self, rl_state: dict[str, Any]) -> str:
        from trainer.pretrain import rng_state

        rank_state = {"rng": rng_state()}
        if self.own_optimizer_state:
            rank_state["optimizer"] = self.optimizer.state_dict()
        # "config" as pretraining checkpoints carry it: the policy then loads like any trained model
        # (e.g. as a distillation teacher, rl/distill/teachers.py)
        state = {"step": self.version, "rl": rl_state, "config": self.config_yaml}
        return str(self.ckpts.save(self.engine, self.version, state, rank_state))

    def resume(self, resume: str) -> Optional[dict[str, Any]]:
        """Restore policy, optimizer and version from the newest valid checkpoint (trainer.resume);
        returns the coordinator's RL state saved with it, or None when starting fresh."""
        from optim import CompositeOptimizer
        from trainer.pretrain import set_rng_state

        ckpt = self.ckpts.resolve(resume)
        if ckpt is None:
            return None
        from trainer.init_weights import checkpoint_attachments

        self.ckpts.attachments = checkpoint_attachments(self.tokenizer, ckpt)
        trainer_state, rank_state = self.ckpts.load(self.engine, ckpt,
                                                    load_optimizer_states=not self.own_optimizer_state)
        if self.own_optimizer_state:
            shards = [s["optimizer"] for s in self.ckpts.all_rank_states(ckpt)]
            self.optimizer.load_state_dict(CompositeOptimizer.merge_state_dicts(shards))
        set_rng_state(rank_state.get("rng", {}))
        self.version = trainer_state["step"]
        return trainer_state["rl"]

