"""Generation for rollouts, distillation and evaluation: a per-layer decode cache that plugs
into the model's sequence hooks (model/runtime.py SequenceShard) and a sampling loop."""
