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

An export with a vision tower (config.json's vision_n_layers > 0) is also run on an image prompt,
which needs REF's `vision.py` too: each row is text, one image's span, text (the image after 7 and
after 40 text tokens), the image a PNG (`--image FILE`, default rendered digits, 112 x 56 px).
  image_preprocessing  the public `load_image` against data/images.prepare_image on the same bytes:
                 patch grid, span token types, and the patches (the public code returns them in
                 bf16, flashtrain in fp32: equal after rounding flashtrain's to bf16)
  image_aligned_*, image_native, image_decode_last_token
                 the comparisons above on the image prompt; both models read the public code's
                 patches (bf16 values), and flashtrain its own spans (token types, ImageBatch),
                 the reference its ImageInput records and token_types
  image_own_preprocessing
                 flashtrain on its own fp32 patches against the aligned reference (kv quant): what
                 the public processor's bf16 patches change
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import json
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import provenance

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
def reference_package(reference: Path, work: Path, vision: bool = False):
    """The public model.py / engram.py / image_processor.py (and vision.py for a model with a vision
    tower) as a package beside the torch kernels above (module `kernel_cpu`); without a tower, a
    vision placeholder."""
    pkg = work / "public_reference"
    pkg.mkdir()
    for name in ("model.py", "engram.py", "image_processor.py", *(("vision.py",) if vision else ())):
        src = reference / name if (reference / name).is_file() else reference / "inference" / name
        if not src.is_file():
            raise SystemExit(f"--reference {reference}: no {name} (nor inference/{name})")
        shutil.copyfile(src, pkg / name)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernel_cpu.py").write_text(f"from bench.system.reference_parity import {', '.join(KERNELS)}  "
                                       "# noqa: F401\n")
    if not vision:
        (pkg / "vision.py").write_text(
            "class _TextOnly:\n    def __init__(self, *a, **k):\n"
            "        raise RuntimeError('bench.system.reference_parity runs text only: '\n"
            "                           'a vision tower is not built')\n"
            "ViT = Aligner = _TextOnly\n")
    sys.path.insert(0, str(work))
    return importlib.import_module("public_reference.model")


def reference_hashes(work: Path) -> dict[str, str]:
    """sha256 of each public file the package was built from (reference_package): which copy of the
    public code a result measured."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((work / "public_reference").glob("*.py"))
            if p.name not in ("__init__.py", "kernel_cpu.py")}


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


def run_reference(ref, model, ids: torch.Tensor, start_pos: int = 0, images=None,
                  token_types=None) -> torch.Tensor:
    """Logits [B, T, V] of `model` (build_reference). The reference picks its GEMM by the weight's
    dtype in a module-level function; the aligned model's fp32 weights take plain fp32 matmuls.
    images / token_types: the public code's image inputs (ImageInput records per row, [B, T] types)."""
    native, dtype = ref.linear, torch.get_default_dtype()
    if model.aligned:
        ref.linear = lambda x, weight, bias=None: F.linear(x.to(weight.dtype), weight)
    else:  # the public code serves under a bf16 default dtype, which its GEMMs return
        torch.set_default_dtype(torch.bfloat16)
    try:
        if images is None:
            return model(ids, start_pos)[1].float()
        return model(ids, start_pos, images=images, token_types=token_types)[1].float()
    finally:
        ref.linear = native
        torch.set_default_dtype(dtype)


def flashtrain_config(config: dict, model_name: str, qat: bool):
    """The flashtrain model config of an export's config.json: the named preset with the export's
    vocabulary and vision tower (vision_* fields; none: no tower)."""
    from conf.model import FlashModelConfig, SmallModelConfig, TinyModelConfig

    base = {"tiny": TinyModelConfig, "small": SmallModelConfig, "flash": FlashModelConfig}[model_name]()
    vision = {k: v for k, v in config.items() if k.startswith("vision_") and hasattr(base, k)}
    return dataclasses.replace(base, vocab_size=config["vocab_size"], kv_quant="qat" if qat else "off",
                               **{"vision_n_layers": 0, **vision})


def build_flashtrain(export: Path, model_name: str, tokenizer_path: Path, qat: bool):
    from data.tokenizer import TextTokenizer
    from model.engram import build_compression_map
    from model.transformer import Transformer
    from trainer.interop.convert import import_into_model

    config = json.loads((export / "config.json").read_text())
    cfg = flashtrain_config(config, model_name, qat)
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


# ------------------------------------------------------------------ the image prompt
IMAGE_AFTER = (7, 40)  # text tokens before the image, per row


def digits_png() -> bytes:
    """The default image: digits drawn on 112 x 56 px (data/images.render_digits), as PNG bytes."""
    import io
    import random

    from data.images import render_digits

    buffer = io.BytesIO()
    render_digits("4719", random.Random(0), height=56, width=112).save(buffer, format="PNG")
    return buffer.getvalue()


@dataclasses.dataclass
class ImageCase:
    """Rows of text, one image's span, text. ids [B, T] (span positions: image_token_id), types
    [B, T] (conf.model: TEXT or a span type), the image's span start in each row, and flashtrain's
    spans of the image (data/images.PreparedImage) with the patches both models read."""
    ids: torch.Tensor
    types: torch.Tensor
    starts: list[int]
    image: object  # data/images.PreparedImage
    patches: torch.Tensor  # [n_h * n_w, 3, p, p] fp32

    def flashtrain_images(self):
        from model.vision import ImageBatch

        n = len(self.starts)
        return ImageBatch([self.patches] * n, [self.image.grid] * n, list(range(n)), list(self.starts))


def image_case(png: bytes, cfg, text: list[int], tokens: int, image_token_id: int,
               after: tuple[int, ...] = IMAGE_AFTER) -> ImageCase:
    """The image prompt of `png` for a flashtrain model config: row r is text[:after[r]], the span,
    then text up to `tokens` positions."""
    from data.images import prepare_image

    image = prepare_image(png, cfg)
    span = len(image.types)
    if max(after) + span >= tokens or len(text) < tokens:
        raise SystemExit(f"--tokens {tokens}: too few for text, a {span}-position image span and text")
    ids, types = [], []
    for prefix in after:
        ids.append(text[:prefix] + [image_token_id] * span + text[prefix:tokens - span])
        types.append([-1] * prefix + image.types + [-1] * (tokens - span - prefix))
    return ImageCase(torch.tensor(ids), torch.tensor(types), list(after), image, image.patches)


def reference_images(image_processor, case: ImageCase, patches: torch.Tensor, grid: tuple[int, int]):
    """The public code's image inputs of the case: per row its ImageInput (span start, patches, patch
    grid, span token types)."""
    types = torch.tensor(case.image.types, dtype=torch.int64)
    return [[image_processor.ImageInput(start=start, patches=patches, n_vit_h=grid[0], n_vit_w=grid[1],
                                        types=types)] for start in case.starts]


def public_preprocessing(image_processor, args, png: bytes, case: ImageCase) -> tuple[dict, torch.Tensor]:
    """The public processor on the PNG against flashtrain's spans of it -> (the comparison, the
    public patches)."""
    try:
        patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = image_processor.load_image({"data": png}, args)
        public_types = image_processor.image_token_types(n_llm_h, n_llm_w).tolist()
    except AttributeError as e:
        raise SystemExit(f"--reference: image_processor.py lacks what this script calls ({e})") from None
    ours = case.image.patches
    same_shape = tuple(patches.shape) == tuple(ours.shape)
    return {
        "patch_grid": [n_vit_h, n_vit_w], "flashtrain_patch_grid": list(case.image.grid),
        "span": len(public_types), "types_equal": public_types == case.image.types,
        "public_patch_dtype": str(patches.dtype).replace("torch.", ""),
        "patches_max_abs_diff_bf16": (ours.bfloat16().float() - patches.float()).abs().max().item()
        if same_shape else None,
        "patches_max_abs_diff": (ours - patches.float()).abs().max().item() if same_shape else None,
    }, patches


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
    p.add_argument("--image", type=Path, default=None, help="the image of the image prompt (an export "
                   "with a vision tower; default: rendered digits)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON object to this file")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    export = args.export.resolve()
    hf_tok = reference_tokenizer(export)
    device = torch.device(args.device)
    ids = token_ids(export / "tokenizer.json", args.batch, args.tokens).to(device)
    vision = json.loads((export / "config.json").read_text()).get("vision_n_layers", 0) > 0
    out = {**provenance.header("bench/system/reference_parity.py"),
           "export": str(export), "tokens": list(ids.shape), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "tokenizer": type(hf_tok).__name__}
    with tempfile.TemporaryDirectory() as work, torch.no_grad(), device:
        ref = reference_package(args.reference.resolve(), Path(work), vision)
        out["reference_sha256"] = reference_hashes(Path(work))
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
        if vision:
            out.update(image_comparisons(ref, export, args, hf_tok, device))
    print(json.dumps(out, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


def image_comparisons(ref, export: Path, args, hf_tok, device: torch.device) -> dict:
    """The comparisons of the module docstring on the image prompt (inside main's no-grad, device
    and package context)."""
    image_processor = importlib.import_module("public_reference.image_processor")
    config = json.loads((export / "config.json").read_text())
    png = args.image.read_bytes() if args.image is not None else digits_png()
    cfg = flashtrain_config(config, args.model, qat=True)
    text = token_ids(export / "tokenizer.json", 1, args.tokens)[0].tolist()
    image_token_id = config.get("image_token_id", 0)
    case = image_case(png, cfg, text, args.tokens, image_token_id)
    public_args = ref.ModelArgs(**config)
    out = {"image": str(args.image) if args.image is not None else "rendered digits 112 x 56 px"}
    out["image_preprocessing"], public_patches = public_preprocessing(image_processor, public_args, png, case)
    ids, types = case.ids.to(device), case.types.to(device)
    grid = tuple(out["image_preprocessing"]["patch_grid"])
    if grid != case.image.grid or not out["image_preprocessing"]["types_equal"]:
        return out  # the spans differ: the models cannot read the same prompt
    case.patches = public_patches.float()  # the values both models read (bf16-exact)

    def ours(qat: bool, patches=None):
        model = build_flashtrain(export, args.model, export / "tokenizer.json", qat)
        images = case.flashtrain_images()
        if patches is not None:
            images.patches = [patches] * len(images)
        return model(ids, token_types=types, images=images.to(device)).logits

    def theirs(aligned: bool, ids=ids, types=types, start_pos: int = 0, model=None):
        model = model or build_reference(ref, export, hf_tok, aligned=aligned)
        patches = public_patches.to(device, torch.float32 if aligned else torch.bfloat16)
        images = reference_images(image_processor, case, patches, grid) if start_pos == 0 else None
        return run_reference(ref, model, ids, start_pos, images=images, token_types=types), model

    for qat in (True, False):
        name = "image_aligned_kv_quant" if qat else "image_aligned_no_quant"
        if not qat:  # the reference with its cache quantisers off, as for the text prompt
            saved = ref.act_quant, ref.fp4_act_quant
            ref.act_quant = ref.fp4_act_quant = lambda x, *a, **k: x
        try:
            reference, aligned = theirs(aligned=True)
        finally:
            if not qat:
                ref.act_quant, ref.fp4_act_quant = saved
        flashtrain = ours(qat)
        out[name] = compare(reference, flashtrain)
        with reference_ties():
            out[name + "_reference_ties"] = compare(reference, ours(qat))
        if qat:
            kv_quant_reference, kv_quant_ours = reference, flashtrain
            out["image_own_preprocessing"] = compare(reference, ours(qat, case.image.patches.to(device)))
    native, _ = theirs(aligned=False)
    out["image_native"] = compare(native, kv_quant_ours)
    out["image_native_vs_aligned_reference"] = compare(native, kv_quant_reference)
    # incremental decoding: the image prompt but its last token prefilled, then that (text) token
    _, aligned = theirs(aligned=True, ids=ids[:, :-1], types=types[:, :-1])
    step, _ = theirs(aligned=True, ids=ids[:, -1:], types=None, start_pos=ids.shape[1] - 1, model=aligned)
    out["image_decode_last_token"] = compare(step[:, -1], kv_quant_ours[:, -1])
    return out


if __name__ == "__main__":
    main()
