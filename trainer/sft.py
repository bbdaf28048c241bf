"""The SFT stage: the pretraining Trainer (engine, optimiser, checkpoints, metrics, resume) on
chat rows with assistant-only labels (data/sft.py), started from a pretraining checkpoint.

Validation loss is over assistant tokens only (the labels of every other position are -100).
At the end of the run the model answers held-out problems of the built-in task greedily at each
effort tier; per tier the accuracy (the task's verifier on the parsed answer) and the mean
response length go to metrics.jsonl and the returned summary (`eval/effort_<E>/...`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from conf.errors import ConfigError
from conf.sft import SFTConfig
from data import DataError, build_datasets
from data.chat import ChatFormat
from data.sft import build_sft_datasets, heldout_problems, load_conversations, load_sft_task, tier_efforts
from trainer.parallelize import full_experts
from trainer.pretrain import Trainer, build_model


class SFTTrainer(Trainer):
    def __init__(self, cfg: SFTConfig, run_dir: Path, config_yaml: str):
        self.sft_cfg = cfg
        tier_efforts(cfg.efforts, cfg.sft.tiers)  # bad tiers fail before anything is built
        # The Trainer sizes sequences (FLOPs, tokens/step, context-parallel slices) by
        # data.seq_len; SFT rows are sft.seq_len long. The tokenizer comes from the unchanged
        # cfg.data (build_data below).
        rows = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=cfg.sft.seq_len))
        super().__init__(rows, run_dir, config_yaml)  # starts from model.init_from
        if self.dist.is_main and self.resumed_from is None and self.initialised_from is None:
            print("flashtrain: warning: sft without model.init_from: fine-tuning randomly initialised "
                  "weights", flush=True)

    def build_data(self):
        cfg = self.sft_cfg
        # the generation eval's problems, held out of the built-in set
        self.task, self.heldout = None, []
        if cfg.sft.source == "builtin" or cfg.eval.problems > 0:
            try:
                self.task = load_sft_task(cfg.sft.builtin_task, cfg.sft.builtin_task_kwargs)
            except DataError as e:
                if cfg.sft.source == "builtin":
                    raise
                if self.dist.is_main:  # own data: train anyway, without the generation eval
                    print(f"flashtrain: warning: no generation eval: {e}", flush=True)
            if self.task is not None:
                self.heldout = heldout_problems(self.task, max(0, cfg.eval.problems), cfg.eval.seed)
        exclude = frozenset(p.prompt for p in self.heldout) if cfg.sft.source == "builtin" else frozenset()
        # read (and check) the chat data first: a malformed row fails before the tokenizer is built
        conversations = load_conversations(cfg.sft, cfg.efforts,
                                           str(Path(cfg.data.cache_dir).expanduser() / "hf"), exclude)
        # the pretraining tokenizer, exactly as pretraining built it
        _, _, tokenizer = build_datasets(cfg.data)
        train, val = build_sft_datasets(cfg.sft, cfg.efforts, tokenizer, conversations=conversations,
                                        model_cfg=cfg.model)
        tc = cfg.trainer
        if train.has_images or val.has_images:
            if tc.engram_tables == "host":
                raise ConfigError("sft data with images and trainer.engram_tables=host: the host tables "
                                  "prefetch rows from the token ids alone, which would read n-grams across "
                                  "image spans")
            if tc.context_parallel > 1:
                raise ConfigError("sft data with images and trainer.context_parallel > 1: an image span must "
                                  "stay on one rank, which sequence slicing does not ensure")
        global_batch = tc.micro_batch_size * max(1, self.dist.world_size // max(1, tc.context_parallel))
        for name, split in (("train", train), ("validation", val)):
            if len(split) < global_batch:
                # the fraction moves rows between them
                grow = "a larger" if name == "validation" else "a smaller"
                raise DataError(f"the SFT {name} split has {len(split)} rows, fewer than one global "
                                f"micro-batch ({global_batch}); use more data, {grow} sft.val_fraction or a "
                                "smaller trainer.micro_batch_size")
        if self.dist.is_main:
            s, v = train.stats, val.stats
            efforts = ", ".join(f"{e}: {n}" for e, n in sorted(s.efforts.items()))
            images = f", {s.images} / {v.images} images" if train.has_images or val.has_images else ""
            print(f"flashtrain sft: {s.conversations} train / {v.conversations} validation conversations -> "
                  f"{len(train)} / {len(val)} rows of {train.seq_len} ({s.fill:.0%} filled){images}, "
                  f"{s.assistant_tokens} assistant tokens to train on; truncated "
                  f"{s.truncated + v.truncated}, dropped {s.dropped + v.dropped}; efforts {{{efforts}}}",
                  flush=True)
        return train, val, tokenizer

    # ------------------------------------------------------------------ generation eval
    def evaluate_generation(self) -> dict[str, float]:
        """Greedy answers to held-out problems at each effort tier (on rank 0; every rank joins
        the expert gather). -> {"eval/effort_<E>/accuracy", ".../mean_len", ".../stopped"}."""
        from inference.generate import generate

        cfg = self.sft_cfg
        if not self.heldout:
            return {}
        with full_experts(self.engine.module, self.layout):
            state = ({k: v.detach().to("cpu", copy=True) for k, v in self.engine.module.state_dict().items()}
                     if self.dist.is_main else None)
        if not self.dist.is_main:
            return {}
        task, problems = self.task, self.heldout
        model = build_model(self.cfg, self.tokenizer)
        model.load_state_dict(state)
        model.to(self.dist.device)
        chat = ChatFormat(self.tokenizer)
        efforts = sorted({cfg.efforts.low, cfg.efforts.high, cfg.efforts.max})
        out: dict[str, float] = {}
        for effort in efforts:
            prompts = [chat.prompt(p.prompt, effort) for p in problems]
            gens = generate(model, prompts, cfg.eval.max_new_tokens, temperature=0.0, stop=chat.stop_ids(),
                            packed=cfg.eval.packed_cache)
            correct, lengths = [], []
            for problem, gen in zip(problems, gens):
                _, answer = chat.parse_response(gen.tokens)
                correct.append(float(task.verify(problem, answer)))
                lengths.append(len(gen.tokens) - (gen.finish == "stop"))
            key = f"eval/effort_{effort}"
            out[f"{key}/accuracy"] = sum(correct) / len(correct)
            out[f"{key}/mean_len"] = sum(lengths) / len(lengths)
            out[f"{key}/stopped"] = sum(g.finish == "stop" for g in gens) / len(gens)
        del model
        lines = " | ".join(f"effort {e}: accuracy {out[f'eval/effort_{e}/accuracy']:.3f}, "
                           f"mean length {out[f'eval/effort_{e}/mean_len']:.1f} tokens" for e in efforts)
        print(f"flashtrain sft: eval ({len(problems)} held-out {cfg.sft.builtin_task} problems, greedy): "
              f"{lines}",
              flush=True)
        return out


def run_sft(cfg: SFTConfig, run_dir: Path, config_yaml: str) -> dict[str, Any]:
    trainer = SFTTrainer(cfg, run_dir, config_yaml)
    try:
        summary = trainer.fit()
        with torch.no_grad():
            scores = trainer.evaluate_generation()
        if scores:
            trainer.log({"step": trainer.step, **scores})
        return {**summary, **scores}
    finally:
        trainer.close()
