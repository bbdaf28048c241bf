"""The pretraining loop: data -> model -> DeepSpeed engine -> steps, evals, checkpoints, metrics."""
from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from conf.errors import ConfigError
from conf.pretrain import PretrainConfig
from data import DistributedBatchLoader, build_datasets
from data.images import ImageTextDataset, load_image_corpus
from data.loader import MixedBatchLoader
from model.accounting import train_flops_per_token
from model.chunking import apply_chunking
from model.csa import ATTENTION_IMPLS
from model.engram import build_compression_map
from model.ops import KernelPolicy
from model.transformer import Transformer
from model.vision import ImageBatch
from optim import CompositeOptimizer, build_optimizer, lr_multiplier
from trainer.backward_reduce import BackwardReducer, check_grad_accum_dtype, grad_dtype_of
from trainer.checkpoint import CheckpointManager
from trainer.context_parallel import slice_batch
from trainer.distributed import DistInfo, all_reduce_sum_, init_distributed
from trainer.engine import build_engine, check_trainer_counts, resolve_precision
from trainer.engram_host import HostEngramTables, check_engram_host_threads, check_engram_tables
from trainer.fp8 import apply_fp8, check_fp8
from trainer.init_weights import checkpoint_attachments, existing_init_source, load_init_weights
from trainer.master_weights import (
    Fp32Grads,
    check_param_dtype,
    check_param_dtype_optimizer,
    fp32_parameters,
)
from trainer.metrics import MetricsLog, device_peak_flops, moe_balance
from trainer.nonfinite import NonFiniteSteps, boundary_step
from trainer.parallelize import (
    CommTimer,
    build_layout,
    check_recompute_modules,
    check_training_layout,
    checkpoint_blocks,
    checkpointed_count,
    clip_grad_norm,
    compile_blocks,
    full_experts,
    optimizer_placement,
    parallelize,
    recompute_modules,
    reduce_gradients,
)
from trainer.progress import Progress
from trainer.tracking import build_tracker


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    if not state:
        return
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def assemble_model(model_cfg, lookup_map: Optional[torch.Tensor] = None,
                   lookup_pad_id: int = 0) -> tuple[Transformer, KernelPolicy]:
    """The plain model of model_cfg with the policies its config names applied from outside: the
    kernel per op (model.kernels), then query and loss chunking (model.attn_chunk_tokens,
    model.loss_chunk_tokens), which wraps whichever loss op the kernel policy installed."""
    model = Transformer(model_cfg, lookup_map=lookup_map, lookup_pad_id=lookup_pad_id)
    policy = KernelPolicy.from_config(model_cfg)
    policy.apply(model)
    apply_chunking(model, model_cfg.attn_chunk_tokens, model_cfg.loss_chunk_tokens)
    return model, policy


def model_config_for(model_cfg, tokenizer):
    """The model config with its vocabulary resolved against the tokenizer (None: the tokenizer's)."""
    if model_cfg.vocab_size is None:
        return dataclasses.replace(model_cfg, vocab_size=tokenizer.vocab_size)
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.vocab_size}")
    return model_cfg


def build_model(cfg: PretrainConfig, tokenizer) -> Transformer:
    model_cfg = cfg.model
    for name, allowed in (("attn_impl", tuple(ATTENTION_IMPLS)), ("indexer_mode", ("sparse", "dense"))):
        if getattr(model_cfg, name) not in allowed:
            raise ConfigError(f"model.{name}={getattr(model_cfg, name)!r}: expected one of "
                              f"{', '.join(allowed)}")
    model_cfg = model_config_for(model_cfg, tokenizer)
    lookup, pad = None, 0
    if model_cfg.engram_layers:
        lookup, _ = build_compression_map(tokenizer.tokenizer, model_cfg.vocab_size)
        pad = int(lookup[tokenizer.pad_id])
    try:
        model, policy = assemble_model(model_cfg, lookup_map=lookup, lookup_pad_id=pad)
    except ValueError as e:  # a chunk size the attention cannot take
        raise ConfigError(f"model.{e}") from None
    if model_cfg.kernels and int(os.environ.get("RANK", "0")) == 0:
        trainer = getattr(cfg, "trainer", None)
        print("flashtrain: " + policy.describe(getattr(trainer, "compile", False),
                                               getattr(trainer, "zero_stage", 0)),
              flush=True)
    return model


class Trainer:
    def __init__(self, cfg: PretrainConfig, run_dir: Path, config_yaml: str,
                 start_from: Optional[Path] = None, train_only_indexer: bool = False,
                 init_setting: str = "model.init_from"):
        """start_from: a checkpoint (or checkpoints dir) whose model weights start a fresh run
        (default: model.init_from, which may also be a public-layout directory; init_setting names
        the setting it came from in errors);
        train_only_indexer: the long-context stage's indexer warm-up (with model.indexer_mode=dense)."""
        self.cfg, self.run_dir, self.config_yaml = cfg, Path(run_dir), config_yaml
        tc = cfg.trainer
        if tc.max_steps <= 0:
            raise ConfigError(f"trainer.max_steps={tc.max_steps}: must be positive")
        check_trainer_counts(tc)  # before the data and the model are built
        check_grad_accum_dtype(tc.grad_accum_dtype, tc.zero_stage)
        check_engram_host_threads(tc.engram_host_threads)
        if start_from is None:
            start_from, init_setting = cfg.model.init_from, "model.init_from"
        if start_from is not None:
            existing_init_source(str(start_from), init_setting)
        # the recompute of a compiled block saves other tensors than its forward: a run compiles the
        # blocks after the checkpointed ones, so some must be left
        if tc.compile and tc.activation_checkpointing and tc.checkpointed_layers is None:
            raise ConfigError("trainer.compile=true with trainer.activation_checkpointing=true is not "
                              "supported: checkpoint recomputation through the compiled blocks fails; turn "
                              "one off, or set trainer.checkpointed_layers=N to compile the blocks after "
                              "the first N")
        if tc.checkpointed_layers is not None and not tc.activation_checkpointing:
            raise ConfigError(f"trainer.checkpointed_layers={tc.checkpointed_layers} needs "
                              "trainer.activation_checkpointing=true")
        check_recompute_modules(tc.recompute_modules)
        self.dist: DistInfo = init_distributed(tc.collective_timeout_s)
        check_fp8(tc.fp8, tc.fp8_emulate, resolve_precision(tc, self.dist.device), tc.zero_stage,
                  self.dist.device)
        check_param_dtype(tc.param_dtype, resolve_precision(tc, self.dist.device), tc.zero_stage)
        if tc.torch_threads:
            torch.set_num_threads(tc.torch_threads)
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(config_yaml)

        seed_everything(tc.seed)  # identical initial weights on every rank
        self.train_ds, self.val_ds, self.tokenizer = self.build_data()
        d = self.dist
        check_training_layout(cfg.model, cfg.data.seq_len, d.world_size, tc.expert_parallel,
                              tc.context_parallel)
        check_engram_tables(tc.engram_tables, tc.context_parallel)
        if tc.plan_check and d.device.type == "cuda":
            self._check_layout_fits()
        self.model = self.build_trained_model()
        if train_only_indexer:  # the indexer warm-up: everything else is frozen
            for name, p in self.model.named_parameters():
                p.requires_grad_(".index_query." in name or ".index_key." in name)
        # float8 matmuls, applied before sharding and compiling (it swaps modules and ops, not parameters)
        self.fp8 = apply_fp8(self.model, tc.fp8, tc.fp8_emulate)
        if self.dist.is_main and tc.fp8 != "none":
            print("flashtrain: " + self.fp8.describe(), flush=True)
        self.total_params = sum(p.numel() for p in self.model.parameters())
        self.flops_per_token = train_flops_per_token(self.model, cfg.data.seq_len)  # before sharding
        self.layout = build_layout(d.rank, d.world_size, tc.expert_parallel, self.model.cfg.n_routed_experts,
                                   tc.context_parallel)
        self.expert_params = parallelize(self.model, self.layout, tc.shared_expert_overlap)
        # host tables leave the model before the engine moves it to the GPU and the optimiser routes it
        self.engram_host = (HostEngramTables(self.model, cfg.optim, d.rank, d.world_size, d.device,
                                             tc.collective_timeout_s, tc.seed, tc.engram_host_threads)
                            if tc.engram_tables == "host" else None)
        checkpointed = (checkpoint_blocks(self.model, tc.checkpointed_layers) if tc.activation_checkpointing
                        else 0)
        recompute_modules(self.model, tc.recompute_modules, start=checkpointed)
        if tc.compile:
            compile_blocks(self.model, start=checkpointed)
        CommTimer.enabled = tc.profile_comm
        self._build_optimizer()
        # context-parallel ranks share samples: the data is sharded over the DP index
        dp, dp_rank = self.layout.dp, self.layout.dp_rank
        self.loader = DistributedBatchLoader(self.train_ds, tc.micro_batch_size, dp_rank, dp, tc.seed)
        self.val_loader = DistributedBatchLoader(self.val_ds, tc.micro_batch_size, dp_rank, dp, tc.seed,
                                                 shuffle=False)
        if cfg.data.image_text_ratio > 0:
            self.loader = self._mix_in_images(self.loader)
        self.ckpts = CheckpointManager(self.run_dir / "checkpoints", tc.keep_last, d.rank)
        self.step, self.tokens_seen = 0, 0
        # host Engram tables: the next step's micro-batches, taken from the loader (and their rows
        # prefetched) a step early, and the loader's position before them
        self._next_micro_batches: Optional[list[dict[str, torch.Tensor]]] = None
        self._data_state: Optional[dict[str, Any]] = None
        self.nonfinite = NonFiniteSteps(tc.max_nonfinite_steps, d.is_main)
        self.resumed_from = self.ckpts.resolve(tc.resume)
        run_id = self._resume(self.resumed_from) if self.resumed_from is not None else None
        self.initialised_from = None
        if self.resumed_from is None and start_from is not None:
            self._load_weights(start_from, init_setting)
        if self.own_optimizer_state:  # trainer.param_dtype=bf16: after every load into the fp32 weights
            self.optimizer.store_params_low_precision()
        # each checkpoint carries the tokenizer and where the weights came from, for `convert export`
        self.ckpts.attachments = checkpoint_attachments(self.tokenizer,
                                                        self.resumed_from or self.initialised_from)
        container = OmegaConf.to_container(OmegaConf.create(config_yaml), resolve=True)
        self.tracker = build_tracker(cfg.logger, self.run_dir, container, run_id, d.rank)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl",
                                  self.step if self.resumed_from is not None else None, d.is_main)
        if self.resumed_from is not None:  # what a killed run logged but W&B never received
            self.tracker.restore(self.metrics.rows())
        self.tokens_per_step = tc.micro_batch_size * cfg.data.seq_len * tc.grad_accum_steps * self.layout.dp
        self.peak_flops, self.peak_source = device_peak_flops(d.device, tc.peak_flops)
        if d.is_main:
            self._announce()

    def _check_layout_fits(self) -> None:
        """The planner's per-rank peak for this run's layout against this GPU, from a meta-device
        model: a layout that cannot fit stops here, before anything is allocated."""
        from trainer.plan import Layout, check_layout_fits

        cfg, tc = self.cfg, self.cfg.trainer
        with torch.device("meta"):
            meta = Transformer(model_config_for(cfg.model, self.tokenizer))
        layout = Layout(self.dist.world_size, ep=tc.expert_parallel, cp=tc.context_parallel,
                        zero_stage=tc.zero_stage, micro_batch=tc.micro_batch_size, seq_len=cfg.data.seq_len,
                        engram_host=tc.engram_tables == "host", grad_accum_dtype=tc.grad_accum_dtype,
                        param_dtype=tc.param_dtype, moe_act="moe_act" in tc.recompute_modules,
                        # the vision tower trains on image-text documents or SFT image turns
                        images=cfg.data.image_text_ratio > 0 or getattr(self.train_ds, "has_images", False))
        gpu = torch.cuda.get_device_properties(self.dist.device)
        checkpointed = (checkpointed_count(meta.cfg.n_layers, tc.checkpointed_layers)
                        if tc.activation_checkpointing else 0)
        check_layout_fits(meta, cfg.optim, layout, checkpointed, gpu.total_memory, gpu.name,
                          tc.grad_accum_steps)

    def build_data(self):
        """(train split, validation split, tokenizer): the packed corpus of cfg.data. A stage that
        trains on other data (SFT) overrides this; the splits need `__len__`, `get_batch`, `seq_len`."""
        return build_datasets(self.cfg.data)

    def build_trained_model(self) -> torch.nn.Module:
        """The module the run trains (the model of cfg.model; the dspark stage trains a drafter)."""
        return build_model(self.cfg, self.tokenizer)

    def _mix_in_images(self, text: DistributedBatchLoader) -> MixedBatchLoader:
        """The text loader mixed with image-text documents by data.image_text_ratio."""
        cfg, tc = self.cfg, self.cfg.trainer
        if self.model.cfg.vision_n_layers == 0:
            raise ConfigError(f"data.image_text_ratio={cfg.data.image_text_ratio} needs a vision tower: "
                              "set model.vision_n_layers > 0")
        if tc.engram_tables == "host":
            raise ConfigError("data.image_text_ratio > 0 with trainer.engram_tables=host: the host tables "
                              "prefetch rows from the token ids alone, which would read n-grams across "
                              "image spans")
        if self.layout.cp > 1:
            raise ConfigError("data.image_text_ratio > 0 with trainer.context_parallel > 1: an image span "
                              "must stay on one rank, which sequence slicing does not ensure")
        train, _ = load_image_corpus(cfg.data)
        images = ImageTextDataset(train, self.tokenizer, self.model.cfg, cfg.data.seq_len)
        layout = self.layout
        loader = DistributedBatchLoader(images, tc.micro_batch_size, layout.dp_rank, layout.dp, tc.seed)
        return MixedBatchLoader(text, loader, cfg.data.image_text_ratio)

    def _build_optimizer(self) -> None:
        cfg, tc, d, layout = self.cfg, self.cfg.trainer, self.dist, self.layout
        replicas, offsets = optimizer_placement(self.model, layout, self.expert_params)
        masters = tc.param_dtype == "bf16"
        if masters:  # the masters are made on the parameters' device
            self.model.to(d.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, tc.zero_stage, d.rank, d.world_size,
                                         verbose=d.is_main, replicas=replicas, row_offsets=offsets,
                                         master_weights=masters, keep_fp32=fp32_parameters(self.model))
        check_param_dtype_optimizer(tc.param_dtype, isinstance(self.optimizer, CompositeOptimizer))
        self.lr_multiplier = lr_multiplier(cfg.optim, tc.max_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_multiplier)
        # Composite (Muon/Sinkhorn or expert-parallel): whole parameters, gradients reduced and
        # clipped here, optimiser state saved per rank by name; otherwise DeepSpeed does all that.
        self.own_optimizer_state = isinstance(self.optimizer, CompositeOptimizer)
        if self.own_optimizer_state:
            self.optimizer.enable_sparse_table_grads(self.model)
        # DeepSpeed broadcasts every parameter from rank 0 at start; expert shards differ per rank
        local_experts = [(p, p.detach().clone()) for p in self.model.parameters()
                         if id(p) in self.expert_params]
        self.engine, self.precision = build_engine(
            self.model, self.optimizer, self.scheduler, tc, d, whole_param_optimizer=self.own_optimizer_state)
        with torch.no_grad():
            for p, data in local_experts:
                p.copy_(data)
        self.backward_reducer = None
        self.masters = self.optimizer.master_of() if self.own_optimizer_state else {}
        if tc.zero_stage == 2 and self.own_optimizer_state:
            self.backward_reducer = BackwardReducer(self.engine.module, layout, self.expert_params,
                                                    self.optimizer.owner_ranks(),
                                                    grad_dtype_of(tc.grad_accum_dtype), masters=self.masters)
        elif tc.grad_accum_dtype != "fp32":
            raise ConfigError(f"trainer.grad_accum_dtype={tc.grad_accum_dtype} applies to the composite "
                              "optimiser (optim=muon or expert parallelism); DeepSpeed's ZeRO already "
                              "keeps bf16 gradients")
        # zero_stage=1 with bf16 parameters: their micro-batch gradients accumulate in fp32
        self.fp32_grads = (Fp32Grads(self.optimizer.low_precision_params())
                           if masters and self.backward_reducer is None else None)

    def _load_weights(self, source, what: str = "model.init_from") -> None:
        """Model weights only (optimiser, schedule and data start fresh): a stage boundary, or
        the released model (a public-layout directory, see trainer/interop)."""
        with full_experts(self.engine.module, self.layout):
            self.initialised_from = load_init_weights(self.engine.module, str(source), what)
        refresh = getattr(self.engine.optimizer, "refresh_fp32_params", None)
        # a partitioned optimiser keeps its own fp32 copies (as DeepSpeed's own load does)
        if callable(refresh):
            refresh()

    def _resume(self, ckpt: Path) -> Optional[str]:
        """Restore everything from `ckpt`; returns the W&B run id."""
        with full_experts(self.engine.module, self.layout):
            trainer_state, rank_state = self.ckpts.load(self.engine, ckpt,
                                                        load_optimizer_states=not self.own_optimizer_state)
        if self.engram_host is not None:
            self.engram_host.load(ckpt)
        if self.own_optimizer_state:
            shards = [s["optimizer"] for s in self.ckpts.all_rank_states(ckpt)]
            self.optimizer.load_state_dict(CompositeOptimizer.merge_state_dicts(shards))
        for group in self.optimizer.param_groups:  # the lr of the step the checkpoint stopped at
            group["lr"] = group["initial_lr"] * self.lr_multiplier(self.scheduler.last_epoch)
        self.loader.load_state_dict(trainer_state["data"])
        set_rng_state(rank_state.get("rng", {}))
        self.step, self.tokens_seen = trainer_state["step"], trainer_state["tokens_seen"]
        return trainer_state.get("wandb_run_id")

    def _announce(self) -> None:
        m, d, total = self.model, self.dist, self.total_params
        start = (f"resuming from {self.resumed_from}" if self.resumed_from else
                 f"weights from {self.initialised_from}" if self.initialised_from else "starting fresh")
        print(f"flashtrain: run {self.run_dir} | model {m.cfg.name}: {total / 1e6:.2f}M params, "
              f"{len(m.plan)} layers ({m.plan.describe()}) | {d.world_size} x {d.device.type} "
              f"{self.precision} ({self.layout.describe()}) "
              f"| {self.tokens_per_step} tokens/step | peak {self.peak_flops / 1e12:.3g} TFLOP/s "
              f"({self.peak_source}) | {start} at step {self.step}", flush=True)

    # ------------------------------------------------------------------ one step
    def _prefetch(self, batches: list[dict[str, torch.Tensor]], train: bool) -> None:
        """Host Engram tables: queue the rows of these micro-batches (a training step's, or an
        evaluation batch), which their forwards take in order."""
        if self.engram_host is not None:
            self.engram_host.prefetch([(b["input_ids"], b.get("doc_ids")) for b in batches], train=train)

    def _batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """On this rank's device; with context parallelism, this rank's slice plus its shard."""
        images = ImageBatch.from_batch(batch)
        batch = {k: v.to(self.dist.device, non_blocking=True) for k, v in batch.items()}
        if images is not None:
            batch["images"] = images.to(self.dist.device)
        if self.layout.cp > 1:
            batch, shard = slice_batch(batch, self.layout)
            batch["shard"] = shard
        return batch

    def train_step(self) -> dict[str, float]:
        tc, engine = self.cfg.trainer, self.engine
        sums = torch.zeros(3, dtype=torch.float64)  # lm, balance, indexer losses
        grad_norm: Optional[float] = None
        skipped = False
        micro_batches, self._next_micro_batches = self._next_micro_batches, None
        if micro_batches is None:
            micro_batches = [self.loader.next_batch() for _ in range(tc.grad_accum_steps)]
            # the rows of later micro-batches arrive while earlier ones compute
            self._prefetch(micro_batches, train=True)
        host = self.engram_host
        for raw in micro_batches:
            batch = self._batch(raw)
            out = engine(**batch)
            lm = out.lm_loss * self._token_share(batch["labels"])
            engine.backward(lm + out.balance_loss + out.indexer_loss)
            if self.backward_reducer is not None:
                self.backward_reducer.finish_micro_batch()
            sums += torch.stack([lm.detach(), out.balance_loss.detach(),
                                 out.indexer_loss.detach()]).double().cpu()
            if not engine.is_gradient_accumulation_boundary():
                engine.step()
                continue
            if self.own_optimizer_state:
                if host is not None:
                    host.reduce_gradients()
                owners = self.optimizer.owner_ranks()
                # at zero_stage=2 only the sparse table gradients are left to reduce here
                reduce_gradients(engine.module, self.layout, self.expert_params, owners,
                                 fp32_grads=self.fp32_grads.take() if self.fp32_grads is not None else None,
                                 masters=self.masters)
                if self.backward_reducer is not None:
                    self.backward_reducer.finish_step()
                grad_norm = clip_grad_norm(engine.module, self.layout, self.expert_params, tc.grad_clip,
                                           sharded=bool(owners), external=host, masters=self.masters)
            elif engine.zero_optimization_stage() == 0:
                grad_norm = self._grad_norm()  # DeepSpeed's ZeRO-0 clips without reporting the norm
            not_finite = not (torch.isfinite(sums).all() and (grad_norm is None or math.isfinite(grad_norm)))
            lr_multiplier = self.lr_multiplier(self.scheduler.last_epoch)  # the lr engine.step applies
            skipped = boundary_step(engine, self.optimizer, not_finite, self.step + 1)
            if host is not None and skipped:
                host.drop_grads()
            elif host is not None:
                host.step(lr_multiplier)
            if host is not None and self.step + 1 < tc.max_steps:
                # the next step's rows are fetched behind this step's optimizer work on the GPU, so its
                # first forward need not wait for them; a checkpoint of this step resumes before them
                self._data_state = self.loader.state_dict()
                self._next_micro_batches = [self.loader.next_batch() for _ in range(tc.grad_accum_steps)]
                self._prefetch(self._next_micro_batches, train=True)
        if grad_norm is None:
            norm = engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")
        all_reduce_sum_(sums)
        sums /= tc.grad_accum_steps * self.dist.world_size
        self.nonfinite.record(self.step + 1, skipped, f"loss {sums[0].item():g}, grad norm {grad_norm:g}")
        balance = self._update_router_biases(apply=not skipped)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return {"loss": sums[0].item(), "balance_loss": sums[1].item(), "indexer_loss": sums[2].item(),
                "grad_norm": grad_norm, "skipped_steps": self.nonfinite.total, **balance}

    def _token_share(self, labels: torch.Tensor) -> torch.Tensor:
        """world * (this rank's labelled tokens) / (all ranks' labelled tokens): averaging the
        scaled per-rank means over ranks gives the mean over every token of the global batch,
        exactly what one process with the whole batch computes."""
        if self.dist.world_size == 1:
            return torch.ones((), device=labels.device)
        counts = (labels != -100).sum().double().reshape(1).cpu()
        total = all_reduce_sum_(counts.clone())
        return (counts * self.dist.world_size / total.clamp(min=1)).squeeze().to(labels.device).float()

    def _grad_norm(self) -> float:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return (torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])).item()
                if grads else 0.0)

    def _device_metrics(self, window_time: float) -> dict[str, float]:
        if self.dist.device.type != "cuda":
            return {}
        out = {"peak_mem_gib": torch.cuda.max_memory_allocated(self.dist.device) / 2**30}
        if CommTimer.enabled:
            out["a2a_share"] = CommTimer.take_seconds() / max(window_time, 1e-9)
        return out

    @torch.no_grad()
    def _update_router_biases(self, apply: bool = True) -> dict[str, float]:
        """Aux-loss-free balancing from the step's global expert load (not applied: the load is
        dropped, as for a skipped step, whose routing saw non-finite scores)."""
        routers = self.engine.module.routers()
        if not apply:
            for r in routers:
                for load in r.loads():
                    load.zero_()
            return {}
        for r in routers:
            for load in r.loads():
                all_reduce_sum_(load)
        balance = moe_balance([r.load for r in routers])
        for r in routers:
            r.update_bias(self.cfg.model.bias_update_speed)
        return balance

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        # token loss sum, tokens, top-k / pool recall sums, batches
        total = torch.zeros(5, dtype=torch.float64)
        for batch in self.val_loader.eval_batches(self.cfg.trainer.eval_batches):
            self._prefetch([batch], train=False)
            batch = self._batch(batch)
            n = (batch["labels"] != -100).sum()
            out = self.engine(**batch, collect_recall=True)
            recall = [float(r) if r is not None else 0.0 for r in (out.topk_recall, out.pool_recall)]
            total += torch.tensor([out.lm_loss.double().item() * n.item(), n.item(), *recall, 1.0],
                                  dtype=torch.float64)
        self.engine.train()
        all_reduce_sum_(total)
        val_loss = (total[0] / total[1].clamp(min=1)).item()
        row = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
        batches = total[4].clamp(min=1)
        # share of the dense attention mass the indexer's top-k (and the layer-20 pool) hold
        row["val_topk_recall"] = (total[2] / batches).item()
        if total[3] > 0:
            row["val_pool_recall"] = (total[3] / batches).item()
        return row

    # ------------------------------------------------------------------ checkpoint
    def save(self) -> None:
        data = self._data_state if self._next_micro_batches is not None else self.loader.state_dict()
        trainer_state = {"step": self.step, "tokens_seen": self.tokens_seen, "data": data,
                         "wandb_run_id": self.tracker.run_id, "config": self.config_yaml}
        rank_state = {"rng": rng_state()}
        if self.own_optimizer_state:
            rank_state["optimizer"] = self.optimizer.state_dict()
        with full_experts(self.engine.module, self.layout):
            self.ckpts.save(self.engine, self.step, trainer_state, rank_state,
                            write_rank_files=self.engram_host.save if self.engram_host is not None else None)

    # ------------------------------------------------------------------ loop
    def log(self, row: dict[str, Any]) -> None:
        self.metrics.write(row)
        self.tracker.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def fit(self) -> dict[str, Any]:
        tc = self.cfg.trainer
        progress = Progress(tc.max_steps, self.step, enabled=self.dist.is_main and tc.progress)
        last: dict[str, Any] = {}
        window_tokens, window_time = 0, 0.0
        saved_at = evaluated_at = self.step if self.resumed_from is not None else -1
        while self.step < tc.max_steps:
            start = time.perf_counter()
            row = self.train_step()
            window_time += time.perf_counter() - start
            window_tokens += self.tokens_per_step
            progress.update(row["loss"])
            if self.step % tc.log_every == 0 or self.step == tc.max_steps:
                tps = window_tokens / max(window_time, 1e-9)
                row.update(step=self.step, lr=self.scheduler.get_last_lr()[0], tokens_per_s=tps,
                           tokens_seen=self.tokens_seen, flops_per_token=self.flops_per_token,
                           mfu=self.flops_per_token * tps / (self.peak_flops * self.dist.world_size),
                           **self._device_metrics(window_time))
                self.log(row)
                last.update(row)
                window_tokens, window_time = 0, 0.0
            if (tc.eval_every and self.step % tc.eval_every == 0) or self.step == tc.max_steps:
                val = self.evaluate()
                self.log({"step": self.step, **val})
                progress.note(f"step {self.step}: val_loss {val['val_loss']:.4f}")
                last.update(val)
                evaluated_at = self.step
            due = ((tc.save_every and self.step % tc.save_every == 0)
                   or (self.step == tc.max_steps and tc.save_at_end))
            if due and self.nonfinite.in_a_row == 0:  # `latest` stays at the last step that updated
                self.save()
                saved_at = self.step
        if evaluated_at != self.step:  # resumed at or past max_steps: still report
            last.update(self.evaluate())
        if saved_at != self.step and tc.save_at_end and self.nonfinite.in_a_row == 0:
            self.save()
        progress.close()
        return last

    def close(self) -> None:
        self.tracker.finish()
        if self.engram_host is not None:
            self.engram_host.close()
        if dist.is_initialized():
            dist.barrier()


def run_pretrain(cfg: PretrainConfig, run_dir: Path, config_yaml: str) -> dict[str, Any]:
    trainer = Trainer(cfg, run_dir, config_yaml)
    try:
        return trainer.fit()
    finally:
        trainer.close()
