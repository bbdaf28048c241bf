"""The inference engine that RL rollouts, distillation, SFT evaluation and `flashtrain generate`
share: a per-layer decode cache that plugs into the model's sequence hooks (model/runtime.py
SequenceShard), a prefix cache, batch slots and a sampling loop."""
