"""Small domain teachers for distillation tests and the CPU acceptance run (bench/system/distill_teachers.py).

A flashtrain teacher is a model fine-tuned on its domains' chat rows (loss on the assistant
turn, as in SFT) and saved in this framework's checkpoint layout (what trainer/checkpoint.py's
load_model_weights reads, plus trainer_state.pt with the model config, like a pretraining
checkpoint), so the teacher registry loads it like any trained model. An HF teacher is a
`transformers` LlamaForCausalLM (a different architecture) on the same tokenizer, saved with
save_pretrained. Everything trains in one process, about a hundred steps per teacher: on a
2-core CPU the point is many distinct teachers cheaply. AdamW at lr 5e-4 (the bench's default):
at 2e-3 a tiny model trained on one domain still answered every prompt with one constant
string after 150 steps, while 5e-4 solved `first` in the same steps.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from data.chat import ChatFormat, Message
from tasks.distill_domains import DomainMixture


def domain_rows(chat: ChatFormat, task: DomainMixture, domains: list[str], count: int, seed: int,
                effort: int) -> list[tuple[list[int], list[bool]]]:
    """`count` (ids, loss mask) chat rows of `domains` (round robin): prompt, empty reasoning, answer."""
    rows = []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        problem = task.sample_domain(domains[i % len(domains)], rng)
        rows.append(chat.encode([Message("user", problem.prompt),
                                 Message("assistant", task.answer_text(problem), reasoning="")], effort))
    return rows


def _batch(rows: list[tuple[list[int], list[bool]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input ids [B, L] and labels [B, L] (-100 outside assistant tokens and padding)."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    for i, (r, m) in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        target = torch.tensor([t if keep else -100 for t, keep in zip(r, m)])
        labels[i, :len(r) - 1] = target[1:]  # position j predicts token j + 1
    return ids, labels


def train_rows(model, rows, steps: int, batch: int, lr: float, pad_id: int, seed: int,
               hf: bool = False) -> float:
    """AdamW on random batches of `rows`; returns the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    loss = torch.zeros(())
    for _ in range(steps):
        ids, labels = _batch(rng.sample(rows, min(batch, len(rows))), pad_id)
        if hf:
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                                     ignore_index=-100)
        else:  # the LM loss only: no indexer or balance terms, which short fine-tunes do not need
            from model.runtime import AttentionRuntime

            loss = model.lm_loss(model.hidden(ids, AttentionRuntime(*ids.shape, ids.device)), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return float(loss.detach())


def save_flashtrain(model, model_cfg, run_dir: Path, step: int = 1) -> Path:
    """The model as <run_dir>/checkpoints/step_N (model states, trainer_state.pt with the model
    config, manifest, `latest`): loadable by load_model_weights and the teacher registry."""
    import dataclasses

    from omegaconf import OmegaConf

    from trainer.checkpoint import LATEST, tag_for, write_manifest

    ckpt = Path(run_dir) / "checkpoints" / tag_for(step)
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.save({"module": model.state_dict()}, ckpt / "mp_rank_00_model_states.pt")
    config = OmegaConf.to_yaml(OmegaConf.create({"model": dataclasses.asdict(model_cfg)}))
    torch.save({"step": step, "config": config}, ckpt / "trainer_state.pt")
    write_manifest(ckpt, step)
    (ckpt.parent / LATEST).write_text(ckpt.name)
    return ckpt


def flashtrain_model(model_cfg, tokenizer, seed: int):
    import dataclasses
    from types import SimpleNamespace

    from trainer.pretrain import build_model

    torch.manual_seed(seed)
    model_cfg = dataclasses.replace(model_cfg, vocab_size=model_cfg.vocab_size or tokenizer.vocab_size)
    return build_model(SimpleNamespace(model=model_cfg), tokenizer), model_cfg


def hf_llama(vocab: int, seed: int, dim: int = 64, layers: int = 2):
    """A tiny transformers Llama: another architecture (dense MLP, plain attention, no mHC,
    Engram or MoE) on the same vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def greedy_answers(model, prompts: list[list[int]], max_new: int, stop: set[int],
                   hf: bool = False) -> list[list[int]]:
    """Greedy responses: the generation engine for flashtrain models, full recompute for HF."""
    if not hf:
        from inference.generate import generate

        return [g.tokens for g in generate(model, prompts, max_new, temperature=0.0, stop=stop)]
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(max_new):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt in stop:
                break
        out.append(ids[len(p):])
    return out


def domain_scores(model, chat: ChatFormat, task: DomainMixture, pairs, max_new: int,
                  hf: bool = False) -> dict[str, dict[str, float]]:
    """Greedy eval on (prompt, problem) pairs (DomainPromptSource.eval_prompts): per domain the
    mean task score and exact-match rate."""
    answers = greedy_answers(model, [p["ids"] for p, _ in pairs], max_new, chat.stop_ids(), hf)
    out: dict[str, list[float]] = {}
    for (p, problem), ids in zip(pairs, answers):
        out.setdefault(p["domain"], []).append(task.verify(problem, chat.parse_response(ids)[1]))
    return {d: {"score": sum(v) / len(v), "exact": sum(x >= 1.0 for x in v) / len(v)} for d, v in out.items()}

