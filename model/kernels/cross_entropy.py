"""The LM head and its cross-entropy, fused: loss and both gradients in the forward (Triton).
Reference: `Transformer.lm_loss` with model.kernels off (chunked `F.cross_entropy(wide(head(x)))`,
each chunk checkpointed).

The reference, per chunk of tokens: logits in bf16 (the head matmul under autocast), an fp32
copy of them, log-softmax, and in the backward the same again (the checkpoint's recomputation)
plus the softmax backward and two matmuls: at a 129K vocabulary, passes over fp32 logits that
cost more than the matmuls' own traffic, and four head matmuls per chunk.

Here, per chunk: logits = x @ W^T in the compute dtype; one kernel takes each row's
log-sum-exp in fp32 (online, one pass) and overwrites the logits in place with
d loss / d logits = softmax - onehot (rounded once to the compute dtype); then dx = g @ W and
dW += g^T @ x (fp32 accumulator, on CUDA inside the GEMM) right away, so the logits die with the chunk. The
backward only scales the saved dx and dW by the incoming gradient: three head matmuls per chunk, no
recomputation. The loss is a summed (not mean) scalar, so the caller's division by the token
count is an ordinary autograd op. Rows labelled `ignore_index` add 0 and get zero gradients.

Contract (`linear_cross_entropy_triton(x, weight, labels, chunk, ignore_index)`):
    x [N, D], weight [V, D], labels [N] int (ignore_index or in [0, V)) -> summed loss, fp32 scalar.
    Under autocast the matmuls run in autocast's dtype (as `F.linear` would); otherwise in
    x's dtype (weight cast to it). Gradients: x's and weight's, in their own dtypes.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _ce_kernel(LOGITS, LABELS, LOSS, V, ignore_index, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    # LOGITS [N, V] (overwritten with softmax - onehot when WRITE_GRAD); LABELS [N]; LOSS [N] fp32
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * V
    label = tl.load(LABELS + row)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)  # lane-wise running max and sum: one pass
    s = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(z == float("-inf"), 0.0,
                                                                                    tl.exp(z - m_new))
        m = m_new
    m_row = tl.max(m, 0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(tl.where(m == float("-inf"), float("-inf"), m - m_row)), 0))
    keep = label != ignore_index
    z_label = tl.load(base + tl.where(keep, label, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(keep, lse - z_label, 0.0))
    if WRITE_GRAD:
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) - tl.where(offs == label, 1.0, 0.0)
            tl.store(base + offs, tl.where(keep, g, 0.0).to(LOGITS.dtype.element_ty), mask=offs < V)


def _rows_ce(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, write_grad: bool) -> torch.Tensor:
    """Per-row loss [N] fp32; with write_grad, logits [N, V] becomes d(sum of losses)/d logits."""
    n, v = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        block = 64 if INTERPRET else 4096
        _ce_kernel[(n,)](logits, labels, loss, v, ignore_index, WRITE_GRAD=write_grad, BLOCK_V=block,
                         num_warps=8)
    return loss


def _plus_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b with acc fp32 and a, b in the compute dtype. On CUDA one GEMM that adds acc in
    its fp32 epilogue (torch's out_dtype matmul; the 16-bit product is never rounded or stored):
    at `small`'s vocabulary that saves a [V, D] bf16 product and an fp32 add pass per chunk.
    Elsewhere (no out_dtype kernel) the product, then the add in place."""
    if acc.is_cuda and a.dtype != acc.dtype:
        return torch.addmm(acc, a, b, out_dtype=acc.dtype)
    return acc.add_(a @ b)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, chunk, ignore_index, dtype):
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(dtype)
        dx = torch.empty_like(x) if want_dx else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_dw else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for lo in range(0, x.shape[0], chunk):
            xc = x[lo:lo + chunk].to(dtype)
            logits = xc @ w.t()  # [n, V]
            total += _rows_ce(logits, labels[lo:lo + chunk], ignore_index, want_dx or want_dw).sum()
            if want_dx:
                dx[lo:lo + chunk] = logits @ w
            if want_dw:
                dw = _plus_mm(dw, logits.t(), xc)
        ctx.save_for_backward(dx, dw)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        dx, dw = ctx.saved_tensors
        gx = None if dx is None else dx * grad.to(dx.dtype)
        gw = None if dw is None else (dw * grad).to(ctx.weight_dtype)
        return gx, gw, None, None, None, None


@torch.compiler.disable  # trainer.compile: a graph break, launched as is (model/kernels/__init__.py)
def linear_cross_entropy_triton(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                chunk: int = 4096, ignore_index: int = -100) -> torch.Tensor:
    """Summed next-token cross-entropy of x [N, D] through the head weight [V, D] (module docstring)."""
    V = weight.shape[0]
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        raise ValueError(f"labels outside [0, {V}) (other than ignore_index={ignore_index}): "
                         f"{labels[bad][:4].tolist()}")
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    with torch.autocast(dev, enabled=False):  # the matmuls run in `dtype` explicitly
        return _LinearCrossEntropy.apply(x, weight, labels.contiguous(), max(1, int(chunk)),
                                         int(ignore_index), dtype)
