"""System benchmarks: the training step, generation, long context, expert parallelism, RL,
distillation, kill-and-resume soaks, parity with the public inference code."""
