"""On-policy distillation: the student samples, a teacher scores every vocabulary entry of every
response token, and the student minimises the full-vocabulary reverse KL (rl/distill/kl.py)."""
