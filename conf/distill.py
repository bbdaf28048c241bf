"""`flashtrain distill`: on-policy distillation of many domain teachers into one student, on the
RL machinery (rl.* settings: rollouts, admission, staleness, workers, checkpoints) plus a
teacher registry and the distillation loss (distill.*)."""
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from conf.rl import RLLoopConfig, rl_defaults
from conf.stage import TrainingStage


@dataclass
class TeacherConfig:
    # flashtrain: a checkpoint or a run's checkpoints/ dir; hf: a save_pretrained dir
    checkpoint: str = MISSING
    # flashtrain (any model config; read from the checkpoint or `model`) | hf (transformers causal LM)
    arch: str = "flashtrain"
    replicas: int = 1  # teacher workers that can serve it
    # the domain's prompts: None = the built-in domain of this name (tasks/distill_domains.py)
    task: Optional[str] = None
    # flashtrain teachers whose checkpoint records no model config (a public-layout directory, or a
    # checkpoint made by `flashtrain convert import`): the model preset that describes it, tiny |
    # small | flash. Not used where the checkpoint records its own (trainer_state.pt).
    model: Optional[str] = None


# The built-in synthetic domains, named here so that the default registry is a declaration; each is
# a string or integer transform in tasks/distill_domains.py (a test keeps the two in step).
BUILTIN_DOMAINS = (
    "reverse", "upper", "capital", "upper_reverse", "first", "last", "first2", "last2", "double", "repeat",
    "mirror", "sort", "sort_desc", "length", "count_a", "rot1", "rot2", "unrot1", "no_vowels", "rotl", "rotr",
    "swap_ends", "odd",
    "add1", "add2", "add3", "add5", "add7", "add10", "add20", "sub1", "sub2", "sub5", "sub10",
    "mul2", "mul3", "mul4", "mul5", "mul10", "mod2", "mod3", "mod5",
)
# The built-in domains and their teachers as
# bench/system/distill_teachers.py makes them under distill.teacher_root: one flashtrain teacher per
# domain, except rot1 and rot2 (one teacher trained on both) and length (a transformers Llama).
SHARED_TEACHERS = {"rot1": "rot", "rot2": "rot"}
KL_MEANS = ("token", "domain")  # distill.kl_mean
HF_TEACHERS = {"length": "hf_length"}


def default_domains() -> dict[str, TeacherConfig]:
    out = {}
    for name in BUILTIN_DOMAINS:
        if name in HF_TEACHERS:
            out[name] = TeacherConfig(checkpoint=HF_TEACHERS[name], arch="hf")
        else:
            out[name] = TeacherConfig(checkpoint=f"{SHARED_TEACHERS.get(name, name)}/checkpoints")
    return out


@dataclass
class DistillLoopConfig:
    teacher_root: str = "teachers"  # relative teacher checkpoints resolve under this directory
    domains: dict[str, TeacherConfig] = field(default_factory=default_domains)
    only: list[str] = field(default_factory=list)  # run these domains only (empty: every domain listed)
    kl_weight: float = 1.0  # on the full-vocabulary reverse KL to the domain's teacher
    # domain: mean of each domain's token mean (short-answer domains weigh as much as long ones; in the
    # recorded CPU acceptance every domain moved toward its teacher, against 40 of 42 by token) |
    # token: mean over all response tokens of the batch (docs/DESIGN.md, Distillation)
    kl_mean: str = "domain"
    # on the RL policy loss (group advantages of the task reward); 0: pure distillation
    reward_weight: float = 0.0
    teacher_workers: int = 2  # Ray actors that host teachers
    max_resident: int = 2  # teachers loaded on a worker's device at once (LRU)
    cpu_cache: int = 8  # evicted teachers a worker keeps in CPU memory (beyond: reloaded from disk)
    teacher_gpus: float = 0.0
    teacher_threads: int = 1  # torch threads per teacher worker (CPU)
    # consecutive prompts drawn from one domain, so batches and teacher calls share a domain
    domain_block: int = 4
    # a teacher is called once it has this many samples waiting (or training needs them)
    teacher_batch: int = 16
    wire_dtype: str = "bfloat16"  # what teachers send: hidden states / log-probs (and heads) in this dtype
    token_chunk: int = 1024  # reverse KL chunking (rl/distill/kl.py)
    vocab_chunk: int = 8192
    eval_prompts: int = 4  # per domain, greedy; with the reverse KL to its teacher on those answers


def distill_rl_defaults() -> RLLoopConfig:
    return RLLoopConfig(efforts=[50], effort_weights=[1.0], group_size=2, prompts_per_step=8,
                        max_new_tokens=16, steps=40, save_every=20, eval_every=0, prompts_per_request=4,
                        rollout_workers=1, max_staleness=1)


@dataclass
class DistillConfig(TrainingStage):
    # model: the student; data: the pretraining corpus, of which only its tokenizer is used (the
    # teachers must share it)
    defaults: list[Any] = field(default_factory=rl_defaults)
    stage: str = "distill"
    rl: RLLoopConfig = field(default_factory=distill_rl_defaults)  # rl.task is set from distill.domains
    distill: DistillLoopConfig = field(default_factory=DistillLoopConfig)
