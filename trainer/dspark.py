"""The dspark stage: the pretraining Trainer (engine, optimiser, checkpoints, metrics, resume) on the
DSpark drafter, with the target frozen beside it (conf/dspark.py).

Each step runs the frozen target over the batch (its logits and the inputs of its tap layers), then
the drafter's loss (model/dspark.py: KL to the target per draft position, and the confidence head's
BCE). The target is not a submodule of the trained module, so the optimiser, DeepSpeed and the
checkpoints hold the drafter only; a checkpoint's state dict loads into a plain `DSpark`.

Metrics per draft position i: `accept_pos<i>` (mean 1 - TV(target, draft), the chance speculative
sampling at temperature 1 accepts the draft, given the drafts before it were) and `top1_pos<i>` (the
draft's argmax is the target's: greedy acceptance). `accept_len` = sum_k prod_{i<k} accept_pos<i>,
the expected drafts accepted per verification at the full block (greedy: `greedy_accept_len`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from conf.dspark import DSparkConfig
from conf.errors import ConfigError
from model.dspark import DraftLoss, DSpark, TapRecorder
from model.transformer import ModelOutput, Transformer
from trainer.checkpoint import model_state, resolve_checkpoint
from trainer.distributed import all_reduce_sum_
from trainer.init_weights import load_init_weights
from trainer.interop.convert import import_drafter, is_public_dir
from trainer.pretrain import Trainer, build_model


class DSparkTraining(DSpark):
    """The drafter as the Trainer trains it: forward(input_ids, labels, doc_ids) runs the frozen
    target, then the drafter's loss, and returns it as a ModelOutput."""

    def __init__(self, target: Transformer, anchor_stride: int):
        super().__init__(target.cfg)
        self.__dict__["target"] = target  # not a submodule: no gradients, optimiser state or checkpoint
        self.anchor_stride = anchor_stride
        self.last: Optional[DraftLoss] = None  # the last forward's loss parts, detached (metrics)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                doc_ids: Optional[torch.Tensor] = None, **_) -> ModelOutput:
        target = self.target
        dtype = self.main_proj.weight.dtype
        if target.embed.weight.dtype != dtype or target.embed.weight.device != input_ids.device:
            target.to(device=input_ids.device, dtype=dtype)  # the drafter reads its embedding and head
        with torch.no_grad(), TapRecorder(target, self.taps) as rec:
            logits = target(input_ids, doc_ids=doc_ids).logits
            taps = rec.take()
        # anchors move with the data, so a resumed run sees exactly what an uninterrupted one does
        offset = int(input_ids[0, 0]) % self.anchor_stride
        out = self.draft_loss(target, taps.to(dtype), input_ids, logits, doc_ids, self.anchor_stride, offset)
        self.last = DraftLoss(**{k: v.detach() for k, v in vars(out).items()})
        return ModelOutput(loss=out.loss, lm_loss=out.kl + out.confidence, balance_loss=out.balance,
                           indexer_loss=out.kl.new_zeros(()))


def accept_lengths(accept: torch.Tensor) -> float:
    """Expected drafts accepted per verification of the whole block from per-position conditional
    acceptances [K]: sum_k prod_{i<=k} accept_i."""
    return float(torch.cumprod(accept.double(), 0).sum())


class SampledRows:
    """Rows of the target's own samples: [rows, seq_len + 1] tokens, one document each."""

    def __init__(self, tokens: np.ndarray):
        self.tokens, self.seq_len = tokens, tokens.shape[1] - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def get_batch(self, indices) -> dict[str, torch.Tensor]:
        t = torch.from_numpy(self.tokens[np.asarray(list(indices), dtype=np.int64)].astype(np.int64))
        return {"input_ids": t[:, :-1], "labels": t[:, 1:], "doc_ids": torch.zeros_like(t[:, :-1])}


class DSparkTrainer(Trainer):
    def __init__(self, cfg: DSparkConfig, run_dir: Path, config_yaml: str):
        ds = cfg.dspark
        if not ds.target:
            raise ConfigError("dspark.target is unset: the drafter trains against a frozen target "
                              "(a checkpoint, run dir or public-layout directory)")
        if ds.source not in ("corpus", "samples"):
            raise ConfigError(f"dspark.source={ds.source!r}: expected corpus or samples")
        if ds.anchor_stride < 1:
            raise ConfigError(f"dspark.anchor_stride={ds.anchor_stride}: must be >= 1")
        if cfg.model.init_from:
            raise ConfigError(f"model.init_from={cfg.model.init_from}: the dspark stage's target comes from "
                              "dspark.target, and a drafter run resumes from its own run dir")
        if cfg.trainer.context_parallel != 1:
            raise ConfigError("trainer.context_parallel: the dspark stage trains on whole rows (1)")
        self.dspark_cfg = ds
        super().__init__(cfg, run_dir, config_yaml)

    def build_data(self):
        train, val, tokenizer = super().build_data()
        cfg, ds = self.cfg, self.dspark_cfg
        self.target = build_model(cfg, tokenizer)
        self.target_from = load_init_weights(self.target, ds.target, "dspark.target")
        self.target.to(self.dist.device).eval()
        for p in self.target.parameters():
            p.requires_grad_(False)
        if ds.source == "samples":
            train = self.sample_rows(train)
        return train, val, tokenizer

    @torch.no_grad()
    def sample_rows(self, corpus) -> SampledRows:
        """The target's continuations of the first sample_prompt_tokens of corpus rows (one generation
        seed for the run: trainer.seed), seq_len + 1 tokens each."""
        from inference.generate import generate

        ds, n = self.dspark_cfg, self.cfg.data.seq_len + 1
        if not 0 < ds.sample_prompt_tokens < n:
            raise ConfigError(f"dspark.sample_prompt_tokens={ds.sample_prompt_tokens}: expected 1..{n - 1}")
        rows = [corpus.get_batch([i % len(corpus)])["input_ids"][0, :ds.sample_prompt_tokens].tolist()
                for i in range(ds.samples)]
        gens = generate(self.target, rows, n - ds.sample_prompt_tokens, temperature=ds.sample_temperature,
                        seed=self.cfg.trainer.seed)
        tokens = np.array([r + g.tokens for r, g in zip(rows, gens)], dtype=np.int64)
        if self.dist.is_main:
            print(f"flashtrain dspark: {len(tokens)} target samples of {n} tokens "
                  f"(temperature {ds.sample_temperature})", flush=True)
        return SampledRows(tokens)

    def build_trained_model(self) -> torch.nn.Module:
        return DSparkTraining(self.target, self.dspark_cfg.anchor_stride)

    def _announce(self) -> None:
        super()._announce()
        d = self.model
        print(f"flashtrain dspark: drafter of {len(d.layers)} blocks, {d.block} draft positions, taps "
              f"{d.taps} of the frozen target from {self.target_from}; trained on {self.dspark_cfg.source}",
              flush=True)

    def train_step(self) -> dict[str, float]:
        row = super().train_step()
        last = self.engine.module.last
        row.update(self._position_metrics(last.accept, last.top1))
        row.update(kl=float(last.kl), confidence_loss=float(last.confidence))
        return row

    @staticmethod
    def _position_metrics(accept: torch.Tensor, top1: torch.Tensor, prefix: str = "") -> dict[str, float]:
        row = {f"{prefix}accept_pos{i}": float(a) for i, a in enumerate(accept)}
        row.update({f"{prefix}top1_pos{i}": float(a) for i, a in enumerate(top1)})
        row[f"{prefix}accept_len"] = accept_lengths(accept)
        row[f"{prefix}greedy_accept_len"] = accept_lengths(top1)
        return row

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        K = self.engine.module.block
        # kl x positions, positions, accept x positions [K], top1 x positions [K], positions [K]
        total = torch.zeros(2 + 3 * K, dtype=torch.float64)
        for batch in self.val_loader.eval_batches(self.cfg.trainer.eval_batches):
            self.engine(**self._batch(batch))
            d = self.engine.module.last
            pos = d.positions.double().cpu()
            total += torch.cat([torch.stack([d.kl.double().cpu() * pos.sum(), pos.sum()]),
                                d.accept.double().cpu() * pos, d.top1.double().cpu() * pos, pos])
        self.engine.train()
        all_reduce_sum_(total)
        pos = total[2 + 2 * K:].clamp(min=1)
        val = (total[0] / total[1].clamp(min=1)).item()
        return {"val_loss": val, **self._position_metrics(total[2:2 + K] / pos, total[2 + K:2 + 2 * K] / pos,
                                                          "val_")}


def load_drafter(path: str, target_cfg, setting: str) -> DSpark:
    """The drafter of a dspark run's checkpoint (a checkpoint, checkpoints/ dir or run dir, or the drafter
    dir `convert import` writes), or of a public-layout directory (its mtp.* tensors), for a target of
    `target_cfg` (its dspark_* keys give the drafter's shape). `setting` names the key in errors."""
    drafter = DSpark(target_cfg)
    if is_public_dir(Path(path)):
        state = import_drafter(Path(path), target_cfg, log=lambda _: None)
    else:
        state = model_state(resolve_checkpoint(Path(path), setting))
    try:
        drafter.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"{setting}={path}: not a drafter of model {target_cfg.name} ({first})") from None
    return drafter.eval()


def load_dspark_run(run: Path):
    """A finished dspark run's (target, drafter, tokenizer, config): the target from dspark.target, the
    tokenizer as the run built it, the drafter from the run's newest checkpoint."""
    from omegaconf import OmegaConf

    from data import build_datasets

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DSparkConfig),
                                              OmegaConf.load(Path(run) / "config.yaml")))
    _, _, tokenizer = build_datasets(cfg.data)
    target = build_model(cfg, tokenizer)
    load_init_weights(target, cfg.dspark.target, "dspark.target")
    target.eval()
    return target, load_drafter(str(run), target.cfg, "drafter"), tokenizer, cfg


def run_dspark(cfg: DSparkConfig, run_dir: Path, config_yaml: str) -> dict[str, Any]:
    trainer = DSparkTrainer(cfg, run_dir, config_yaml)
    try:
        return trainer.fit()
    finally:
        trainer.close()
