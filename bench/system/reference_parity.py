"""Parity of a flashtrain export with the public reference inference code, on a CPU or a GPU.

    python -m bench.system.reference_parity --reference REF --export DIR [--model tiny] [--tokens 256]
        [--device cuda]

REF is a directory holding the public DeepSeek-V4.1-Flash inference code as published beside the
released weights (`model.py`, `engram.py`, `image_processor.py`). It is not part of flashtrain and is
not shipped with it. Its kernels are tilelang, for the GPU only, so this script supplies plain torch
versions of the six it imports (used on either device), written here from the kernels' documented
semantics:

  act_quant      FP8 E4M3 per block of the last dim, scale amax/448 (amax >= 1e-4), power of two
                 (rounded up) when a scale format is given; values clamped to +-448
  fp4_act_quant  E2M1 per block, scale 2^ceil(log2(amax/6)) (amax >= 6*2^-126) as E8M0, or
                 E4M3(amax/6) (amax >= 6*2^-9) as E4M3; round to nearest, ties to even
  fp8_gemm       dequantised activation (a scale per 32) times dequantised weight (32x32 blocks)
  fp4_gemm       the same with a packed E2M1 weight (low nibble first, a scale per 32 inputs)
  hc_split_sinkhorn  pre = sigmoid + eps, post = 2 sigmoid, comb = row softmax + eps, then
                 column / row normalisations, every denominator + eps
  sparse_attn    softmax over the selected keys and the per-head sink, -1 = no key

The export is loaded into the reference Transformer as it is (config.json unedited, strict state
dict), and into flashtrain through `trainer.interop`; both run the same token ids (text of the
Python standard library, tokenized with the export's own tokenizer).

Two comparisons, each the relative Frobenius error of the logits of every position and the top-1
agreement:
  aligned  the reference with its weights dequantised to fp32 and its linears unquantised, as
           flashtrain trains (the KV caches keep their FP8/FP4 quantisation on both sides); the
           two should agree to float rounding
  native   the reference as it serves: FP8/FP4 weights, FP8 activations into every GEMM, bf16;
           its difference from `aligned` is the reference's own quantisation noise
plus the reference's incremental decoding (prefill, then one token) against flashtrain's logits at
that position, and, as a diagnostic, `aligned` with flashtrain's top-k made by the reference's own
torch.topk call: the two differ only where index scores tie at the k-th place (flashtrain breaks
such ties towards the lowest entry ids, the public code leaves them to torch.topk, which on a GPU
does the same and on a CPU does not). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------ torch kernels for the reference
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    mant, exp = torch.frexp(v)
    return torch.ldexp(torch.ones_like(v), torch.where(mant == 0.5, exp - 1, exp))


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of v (already within +-6), ties to the even code."""
    grid = E2M1_GRID.to(v.device)
    mag = v.abs().unsqueeze(-1)
    dist = (mag - grid).abs()
    best = dist.min(-1, keepdim=True).values
    tied = dist == best
    code = torch.where(tied.sum(-1) > 1,
                       (tied & (torch.arange(8, device=v.device) % 2 == 0)).float().argmax(-1),
                       tied.float().argmax(-1))
    return torch.copysign(grid[code], v)


def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    xb = x.float().unflatten(-1, (-1, block_size))
    s = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1.0 / 448.0)
    if scale_fmt is not None:
        s = _pow2_ceil(s)
    q = (xb / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    if inplace:
        x.copy_((q.float() * s).flatten(-2).to(x.dtype))
        return x
    return q.flatten(-2), s.squeeze(-1).to(scale_dtype)


def fp4_act_quant(x, block_size=32, inplace=False, scale_dtype=torch.float8_e8m0fnu):
    xb = x.float().unflatten(-1, (-1, block_size))
    amax = xb.abs().amax(-1, keepdim=True)
    if scale_dtype == torch.float8_e4m3fn:
        s = (amax.clamp_min(6 * 2.0**-9) / 6.0).to(torch.float8_e4m3fn).float()
    else:
        s = _pow2_ceil(amax.clamp_min(6 * 2.0**-126) * (1.0 / 6.0))
    q = _round_e2m1((xb / s).clamp(-6.0, 6.0))
    if not inplace:
        raise RuntimeError("the reference model only quantises its caches in place")
    x.copy_((q * s).flatten(-2).to(x.dtype))
    return x


def _dequant_fp8_weight(w, s, block=32):
    rows, cols = w.shape
    scale = s.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return w.float() * scale


def _dequant_fp4_weight(w, s, block=32):
    packed = w.view(torch.uint8)
    nibbles = torch.stack((packed & 0xF, packed >> 4), -1).flatten(-2).long()
    values = torch.where(nibbles >= 8, -1.0, 1.0) * E2M1_GRID.to(w.device)[nibbles & 7]
    return values * s.float().repeat_interleave(block, -1)


def _act(a, a_s, block):
    return (a.float().unflatten(-1, (-1, block)) * a_s.float().unsqueeze(-1)).flatten(-2)


def fp8_gemm(a, a_s, b, b_s, scale_dtype=None, block_size=32):
    return (_act(a, a_s, block_size) @ _dequant_fp8_weight(b, b_s).T).to(torch.get_default_dtype())


def fp4_gemm(a, a_s, b, b_s, scale_dtype=None, act_block_size=32):
    return (_act(a, a_s, act_block_size) @ _dequant_fp4_weight(b, b_s).T).to(torch.get_default_dtype())


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    n = hc_mult
    pre = torch.sigmoid(mixes[..., :n] * hc_scale[0] + hc_base[:n]) + eps
    post = 2 * torch.sigmoid(mixes[..., n:2 * n] * hc_scale[1] + hc_base[n:2 * n])
    comb = (mixes[..., 2 * n:] * hc_scale[2] + hc_base[2 * n:]).unflatten(-1, (n, n))
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    b, m, h, d = q.shape
    idx = topk_idxs.long()
    keys = torch.gather(kv.float().unsqueeze(1).expand(b, m, -1, d), 2,
                        idx.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, d))  # [b, m, k, d]
    scores = torch.einsum("bmhd,bmkd->bmhk", q.float(), keys) * softmax_scale
    scores = scores.masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    sink = attn_sink.float().view(1, 1, h, 1).expand(b, m, h, 1)
    p = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
    return torch.einsum("bmhk,bmkd->bmhd", p, keys).to(q.dtype)


KERNELS = dict(act_quant=act_quant, fp4_act_quant=fp4_act_quant, fp4_gemm=fp4_gemm, fp8_gemm=fp8_gemm,
               hc_split_sinkhorn=hc_split_sinkhorn, sparse_attn=sparse_attn)


# ------------------------------------------------------------------ loading both models
def reference_package(reference: Path, work: Path):
    """The public model.py / engram.py / image_processor.py as a package beside the torch kernels
    above (module `kernel_cpu`) and a vision placeholder (the check runs text only)."""
    pkg = work / "public_reference"
    pkg.mkdir()
    for name in ("model.py", "engram.py", "image_processor.py"):
        src = reference / name if (reference / name).is_file() else reference / "inference" / name
        if not src.is_file():
            raise SystemExit(f"--reference {reference}: no {name} (nor inference/{name})")
        shutil.copyfile(src, pkg / name)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernel_cpu.py").write_text(f"from bench.system.reference_parity import {', '.join(KERNELS)}  "
                                       "# noqa: F401\n")
    (pkg / "vision.py").write_text(
        "class _TextOnly:\n    def __init__(self, *a, **k):\n"
        "        raise RuntimeError('bench.system.reference_parity runs text only: '\n"
        "                           'a vision tower is not built')\n"
        "ViT = Aligner = _TextOnly\n")
    sys.path.insert(0, str(work))
    return importlib.import_module("public_reference.model")


def build_reference(ref, export: Path, tokenizer, aligned: bool):
    from safetensors.torch import load_file

    config = json.loads((export / "config.json").read_text())
    args = ref.ModelArgs(**config)
    args.max_batch_size = 2
    torch.set_default_dtype(torch.float32 if aligned else torch.bfloat16)
    try:
        model = ref.Transformer(args, tokenizer)
    finally:
        torch.set_default_dtype(torch.float32)
    state = {}
    for shard in sorted(export.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    model.load_state_dict(state, strict=True)
    if aligned:  # fp32 dequantised weights, plain matmuls: flashtrain's training-time linears
        for module in model.modules():
            w = getattr(module, "weight", None)
            scale = getattr(module, "scale", None)
            if isinstance(w, torch.nn.Parameter) and scale is not None and w.dtype in (
                    torch.float8_e4m3fn, torch.float4_e2m1fn_x2):
                if isinstance(module, ref.ParallelEngramEmbedding):
                    continue  # dequantised by the module itself on lookup (exactly, into bf16)
                full = (_dequant_fp4_weight(w, scale) if w.dtype == torch.float4_e2m1fn_x2
                        else _dequant_fp8_weight(w, scale))
                module.weight = torch.nn.Parameter(full)
                module.register_parameter("scale", None)
        for p in model.parameters():
            if p.dtype == torch.bfloat16:
                p.data = p.data.float()
    # every position's logits, not only the last (the reference's head defaults to generation)
    head_forward = model.head.forward
    model.head.forward = lambda x, full_logits=True: head_forward(x, full_logits=True)
    model.aligned = aligned
    return model.eval()


def run_reference(ref, model, ids: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
    """Logits [B, T, V] of `model` (build_reference). The reference picks its GEMM by the weight's
    dtype in a module-level function; the aligned model's fp32 weights take plain fp32 matmuls."""
    native, dtype = ref.linear, torch.get_default_dtype()
    if model.aligned:
        ref.linear = lambda x, weight, bias=None: F.linear(x.to(weight.dtype), weight)
    else:  # the public code serves under a bf16 default dtype, which its GEMMs return
        torch.set_default_dtype(torch.bfloat16)
    try:
        return model(ids, start_pos)[1].float()
    finally:
        ref.linear = native
        torch.set_default_dtype(dtype)


def build_flashtrain(export: Path, model_name: str, tokenizer_path: Path, qat: bool):
    from conf.model import FlashModelConfig, SmallModelConfig, TinyModelConfig
    from data.tokenizer import TextTokenizer
    from model.engram import build_compression_map
    from model.transformer import Transformer
    from trainer.interop.convert import import_into_model

    config = json.loads((export / "config.json").read_text())
    base = {"tiny": TinyModelConfig, "small": SmallModelConfig, "flash": FlashModelConfig}[model_name]()
    cfg = dataclasses.replace(base, vocab_size=config["vocab_size"], kv_quant="qat" if qat else "off")
    tok = TextTokenizer.from_file(tokenizer_path)
    lookup, _ = build_compression_map(tok.tokenizer, cfg.vocab_size)
    model = Transformer(cfg, lookup_map=lookup, lookup_pad_id=int(lookup[config.get("engram_pad_id", 2)]))
    import_into_model(model, export, log=lambda _: None)
    return model.eval()


@contextlib.contextmanager
def reference_ties():
    """flashtrain's top-k selection made by torch.topk(sorted=False), as the public code selects:
    the same ids wherever no two scores tie at the k-th place."""
    import model.indexer as indexer

    def torch_topk(scores, k):
        values, cols = scores.topk(k, dim=-1, sorted=False)
        order = cols.sort(-1)
        return order.values, values.gather(-1, order.indices)

    own, indexer.topk_ids = indexer.topk_ids, torch_topk
    try:
        yield
    finally:
        indexer.topk_ids = own


class _RustTokenizer:
    """What the public code reads of its tokenizer (the Engram token map): the Rust backend and the
    vocabulary size with added tokens, as transformers' tokenizer gives them."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_file(str(path))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def reference_tokenizer(export: Path):
    """transformers' AutoTokenizer of the export, as a user of the public code loads it; where
    transformers is not installed (the GPU machines), the same Rust tokenizer without it."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return _RustTokenizer(export / "tokenizer.json")
    return AutoTokenizer.from_pretrained(str(export))


def token_ids(tokenizer_path: Path, batch: int, tokens: int) -> torch.Tensor:
    """Text of the standard library's own sources, `batch` windows of `tokens` ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    text = "".join(p.read_text()
                   for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-c]*.py"))[:20])
    ids = tok.encode(text, add_special_tokens=False).ids
    return torch.tensor([ids[i * 997:i * 997 + tokens] for i in range(batch)])


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a, b = a.double(), b.double()
    return {"rel_err": ((a - b).norm() / b.norm()).item(),
            "top1_agree": (a.argmax(-1) == b.argmax(-1)).double().mean().item()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reference", type=Path, required=True)
    p.add_argument("--export", type=Path, required=True)
    p.add_argument("--model", default="tiny", choices=("tiny", "small", "flash"))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: both models on the GPU (the public "
                   "code's own device, where torch.topk breaks ties as flashtrain does)")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    export = args.export.resolve()
    hf_tok = reference_tokenizer(export)
    device = torch.device(args.device)
    ids = token_ids(export / "tokenizer.json", args.batch, args.tokens).to(device)
    out = {"export": str(export), "tokens": list(ids.shape), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "tokenizer": type(hf_tok).__name__}
    with tempfile.TemporaryDirectory() as work, torch.no_grad(), device:
        ref = reference_package(args.reference.resolve(), Path(work))
        logits = {}
        for qat in (True, False):
            ours = build_flashtrain(export, args.model, export / "tokenizer.json", qat)(ids).logits
            if not qat:  # the reference with its cache quantisers off: no quantisation anywhere
                saved = ref.act_quant, ref.fp4_act_quant
                ref.act_quant = ref.fp4_act_quant = lambda x, *a, **k: x
            try:
                aligned = build_reference(ref, export, hf_tok, aligned=True)
                theirs = run_reference(ref, aligned, ids)
            finally:
                if not qat:
                    ref.act_quant, ref.fp4_act_quant = saved
            out["aligned_kv_quant" if qat else "aligned_no_quant"] = compare(theirs, ours)
            logits[qat] = (ours, theirs, aligned)
        # flashtrain breaks ties at the k-th index score (ReLU zeros) towards the lowest entry ids;
        # the public code leaves them to torch.topk. The same comparisons with flashtrain's
        # selection made by that very call isolate everything else.
        for qat, name in ((True, "aligned_kv_quant"), (False, "aligned_no_quant")):
            with reference_ties():
                tied = build_flashtrain(export, args.model, export / "tokenizer.json", qat)(ids).logits
            out[name + "_reference_ties"] = compare(logits[qat][1], tied)
        ours, aligned_logits, aligned = logits[True]
        native = build_reference(ref, export, hf_tok, aligned=False)
        native_logits = run_reference(ref, native, ids)
        out["native"] = compare(native_logits, ours)
        out["native_vs_aligned_reference"] = compare(native_logits, aligned_logits)
        # incremental decoding: the last token after a prefill of the others, fp32 reference
        aligned = build_reference(ref, export, hf_tok, aligned=True)
        run_reference(ref, aligned, ids[:, :-1])
        step = run_reference(ref, aligned, ids[:, -1:], ids.shape[1] - 1)
        out["decode_last_token"] = compare(step[:, -1], ours[:, -1])
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
