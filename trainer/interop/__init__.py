"""Interop with the public DeepSeek-V4.1-Flash checkpoint layout (sharded safetensors + config.json).

  codec.py    the stored encodings (bf16, fp32, FP8 32x32 blocks, FP4 experts, FP8 Engram rows)
  layout.py   flashtrain state-dict names <-> public tensor names, shapes, encodings; config.json
  convert.py  import (public -> flashtrain weights) and export (flashtrain -> public), part by part

`trainer.init_weights.load_init_weights` is the one entry point the training stages call.
"""
