"""`flashtrain rl`: GRPO-style RL with rollouts, rewards and training as Ray actors.

`rl.async` is spelled `async_` in Python (a keyword); the CLI accepts `rl.async=false`."""
from dataclasses import dataclass, field
from typing import Any, Optional

from conf.stage import TrainingStage, training_defaults


@dataclass
class RLLoopConfig:
    # extra `flashtrain sft` overrides for that SFT. 140 steps, not sft's 200: greedy answers are
    # right (0.85) but sampled ones are not yet (0.4), which leaves RL a reward to raise; after
    # 200 steps the policy has memorised the task and its sampled reward is flat at ~0.8.
    sft_overrides: list[str] = field(default_factory=lambda: ["trainer.max_steps=140"])
    # built-in name (arithmetic, algebra, python, synth, synth_propose) or a dotted path to a Task class
    task: str = "arithmetic"
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    steps: int = 60  # trainer updates (policy versions)
    prompts_per_step: int = 8  # prompt groups per update
    group_size: int = 8  # samples per prompt (GRPO group)
    max_new_tokens: int = 40
    temperature: float = 1.0
    top_p: float = 1.0
    efforts: list[int] = field(default_factory=lambda: [50, 75, 100])  # sampled per prompt...
    effort_weights: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])  # ...with these weights
    length_penalty_base: float = 8.0  # the penalty at effort 1 is `base` times the one at effort 100
    length_penalty_scale: float = 0.2  # coefficient at effort 100, on length / max_new_tokens
    # group advantages divide by max(std, this): no unit advantage from a 1-token gap
    adv_std_floor: float = 0.1
    # failed cases replayed (rl/replay.py): this share of new prompts serve the oldest problem whose
    # every sample scored 0, at most replay_capacity kept, each for replay_max_age versions after its
    # first failure and at most replay_max_serves times (0.0: no replay)
    replay_fraction: float = 0.0
    replay_capacity: int = 256
    replay_max_age: int = 20
    replay_max_serves: int = 2
    flat_reward_warn_steps: int = 5  # warn when this many steps in a row had every advantage 0 (0: never)
    clip_low: float = 0.2
    clip_high: float = 0.28
    ppo_epochs: int = 1  # passes over each batch (one policy version)...
    minibatches: int = 1  # ...each split into this many optimizer steps
    is_cap: float = 2.0  # truncated importance sampling: ratios to the behaviour policy capped here
    max_staleness: int = 1  # tokens more than this many versions old are masked out of the loss
    async_: bool = True  # rollouts and training overlap (false: generate, score, train, repeat)
    rollout_workers: int = 2
    reward_workers: int = 1
    trainer_workers: int = 1  # DeepSpeed data-parallel ranks (one Ray actor each)
    prompts_per_request: int = 2  # prompts per rollout call
    rollout_batch: int = 16  # sequences a rollout worker decodes together
    # the rollout engine computes what the trainer's forward does: a quantised (packed) KV cache only
    # when the policy trains with model.kv_quant=qat, and CED prefill only for prompts longer than
    # rollout_replay (null: every layer over the whole prompt, exactly the training forward)
    rollout_replay: Optional[int] = 128
    rollout_threads: int = 1  # torch threads per rollout worker (CPU)
    # a rollout worker on a GPU runs its decode step's forward through torch.compile (inductor) before
    # capturing it in a CUDA graph: fewer, fused kernels a step, paid for by compiling once per worker
    rollout_compile: bool = False
    # a `flashtrain dspark` run (or checkpoint), the drafter dir `convert import` writes, or a public-layout
    # dir (its mtp.* drafter): the rollout workers decode with that drafter (inference/speculative.py:
    # the samples' distribution and log-probs stay the policy's); null: none
    drafter: Optional[str] = None
    trainer_gpus: float = 0.0  # GPUs per trainer actor (0 on CPU)
    # GPUs per rollout worker; above 0 it decodes on its GPU in the trainer's precision there. Fractions
    # share one GPU: trainer_gpus=0.5 with two rollout workers at 0.25 puts every actor on one card
    rollout_gpus: float = 0.0
    timeout_s: float = 300.0  # any one generation, scoring, weight transfer or training call
    save_every: int = 10  # versions between checkpoints (0: only at the end)
    eval_every: int = 10  # versions between greedy evaluations (0: start and end only)
    eval_prompts: int = 16  # per effort
    seed: int = 0
    ray_address: Optional[str] = None  # None: start a local Ray instance
    ray_num_cpus: Optional[int] = None


def rl_defaults() -> list[Any]:
    return training_defaults("rl")  # AdamW, constant fine-tuning lr


@dataclass
class RLConfig(TrainingStage):
    # data: the pretraining corpus, of which only its tokenizer is used
    defaults: list[Any] = field(default_factory=rl_defaults)
    stage: str = "rl"
    rl: RLLoopConfig = field(default_factory=RLLoopConfig)
