"""Triton kernels for the hot paths. Each module sits beside the plain-PyTorch reference it
replaces (named in its docstring); tests compare the two, and the model selects a kernel by
config while the reference path stays available. Without a GPU the kernels run in Triton's
interpreter (TRITON_INTERPRET=1), which the CPU tests use in fp32.

Under torch.compile (trainer.compile per block, a decode step's `compile`) each kernel's entry point is
`torch.compiler.disable`d: a graph break, so the kernel launches exactly as in eager mode and
inductor fuses only the PyTorch ops around it. Left to trace them, inductor recompiles the
user kernels itself and passes Python float arguments (softmax scales) as fp64, which changes
the loop-carried types the kernels were written for."""
