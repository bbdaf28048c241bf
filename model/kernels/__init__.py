"""Triton kernels for the hot paths. Each module sits beside the plain-PyTorch reference it
replaces (named in its docstring); tests compare the two, and the model selects a kernel by
config while the reference path stays available. Without a GPU the kernels run in Triton's
interpreter (TRITON_INTERPRET=1), which the CPU tests use in fp32."""
