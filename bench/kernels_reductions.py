"""The fp32 reductions of the backward kernels, scalar (`tl.atomic_add`: one
atom.global...add.f32 an element) against four an instruction (`model/kernels/atomics.py`:
red.global.add.v4.f32), side by side at `small`'s step shape (micro-batch 8 x 4096 queries, k = 512):

  rate      GB/s of fp32 row adds into the selected rows, one program a query (the access pattern of
            `attention_floor`'s atomic ceiling), both ways on the same index tensor
  attention `_bwd_kernel`'s GPU time (H = 16, C = 512, W = 128) with the sparse attention module's
            VEC_RED off and on, each autotuned, and how far apart the gradients of the selected rows
            land (fp32 adds in another order: relative max difference)
  indexer   `_scores_at_bwd_kernel` (the indexer KL's backward at the selected entries, 16 heads x
            128) the same way, and `indexer_tiles` at a few tiles each way (the vector form frees
            registers, so the best tile may move)

Layer kinds as in `attention_floor`: `m1` a decoder layer (S = 4096 entries), `m2` an encoder layer
(S = 2048). The modules' VEC_RED defaults are left as they were found.
"""
from __future__ import annotations

import torch

from bench.kernel_timing import kernel_ms, timed_ms
from bench.kernels_attention_floor import B, C, H, K, T, W, _add_rows, _attention_inputs, _selection

INDEX_HEADS, INDEX_DIM = 16, 128


def _rates(idx: torch.Tensor, S: int) -> dict:
    selected = int((idx >= 0).sum())
    out = {}
    for name, vec in (("scalar", False), ("v4", True)):
        dg = torch.zeros(B, S, C, device=idx.device)

        def add(block_n: int, vec=vec, dg=dg):
            _add_rows[(B * T,)](dg, idx, T, S, K, C=C, BLOCK_N=block_n, VEC=vec, num_warps=4)

        ms = min(timed_ms(lambda bn=bn: add(bn)) for bn in (16, 32))
        dg.zero_()
        add(32)
        out[f"{name}_gbs"] = selected * C * 4 / ms / 1e6
        out[f"{name}_adds_exact"] = dg.sum(dtype=torch.float64).item() == selected * C  # every 1.0 landed
    out["v4_over_scalar"] = out["v4_gbs"] / out["scalar_gbs"]
    return out


def _both_ways(module, run, kernel: str) -> dict:
    """kernel's GPU time under run() with module.VEC_RED off and on, and run()'s outputs' max
    relative difference between the two."""
    found = module.VEC_RED
    out, grads = {}, {}
    try:
        for vec in (False, True):
            module.VEC_RED = vec
            out[f"{'v4' if vec else 'scalar'}_ms"] = kernel_ms(run, name=kernel)
            grads[vec] = run()
    finally:
        module.VEC_RED = found
    out["speedup"] = out["scalar_ms"] / out["v4_ms"]
    out["max_rel_diff"] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                              for a, b in zip(grads[True], grads[False]))
    return out


# the indexer KL backward's tiles at `small`'s shape (candidates a tile, warps, stages); the first is
# `model.kernels.indexer._at_blocks`'s choice, swept without the vector form (DESIGN)
INDEXER_TILES = ((128, 4, 2), (64, 4, 2), (128, 8, 2), (64, 8, 2), (64, 4, 3))


def _indexer_tiles(ki, run) -> list[dict]:
    """`_scores_at_bwd_kernel`'s time at each of INDEXER_TILES, both ways; a tile that does not
    build here is a row with its error."""
    found_blocks, found_vec = ki._at_blocks, ki.VEC_RED
    rows = []
    try:
        for vec in (False, True):
            ki.VEC_RED = vec
            for block_p, warps, stages in INDEXER_TILES:
                def blocks(H, Di, backward=False, block_p=block_p, warps=warps, stages=stages):
                    out = found_blocks(H, Di, backward)
                    if backward:
                        out.update(BLOCK_P=block_p, num_warps=warps, num_stages=stages)
                    return out

                ki._at_blocks = blocks
                row = {"vec": vec, "block_p": block_p, "warps": warps, "stages": stages}
                try:
                    row["ms"] = kernel_ms(run, name="_scores_at_bwd_kernel")
                except Exception as e:  # shared memory or registers
                    row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                rows.append(row)
    finally:
        ki._at_blocks, ki.VEC_RED = found_blocks, found_vec
    return rows


def _layer(ratio: int, device) -> dict:
    import model.kernels.indexer as ki
    import model.kernels.sparse_attention as sa

    S = T // ratio
    idx = _selection(S, ratio, device)
    q, win, glob, sink, doc, dout = _attention_inputs(S, ratio, device)

    def attention():
        out, _ = sa.sparse_attention_triton(q, win, glob, idx, doc, sink, C ** -0.5, W, want_probs=False)
        return torch.autograd.grad(out, [q, win, glob], dout)

    g = torch.Generator(device=device).manual_seed(ratio)
    r = lambda *shape: torch.randn(*shape, device=device, generator=g, dtype=torch.bfloat16).requires_grad_()
    iq, ik = r(B, T, INDEX_HEADS, INDEX_DIM), r(B, S, INDEX_DIM)
    iw = torch.randn(B, T, INDEX_HEADS, device=device, generator=g).requires_grad_()
    up = torch.randn(B, T, K, device=device, generator=g)

    def indexer():
        scores = ki.index_scores_at_triton(iq, iw, ik, idx)
        return torch.autograd.grad(scores, [iq, iw, ik], torch.where(idx >= 0, up, 0.0))

    return {"S": S, "selected_per_query": int((idx >= 0).sum()) / (B * T), "rate": _rates(idx, S),
            "attention": _both_ways(sa, attention, "_bwd_kernel"),
            "indexer": _both_ways(ki, indexer, "_scores_at_bwd_kernel"),
            "indexer_tiles": _indexer_tiles(ki, indexer)}


def bench(device) -> dict:
    torch.cuda.set_device(device)
    dev = torch.device("cuda", torch.cuda.current_device())
    out = {"micro_batch": B, "queries": T, "heads": H, "latent": C, "topk": K, "window": W,
           "index_heads": INDEX_HEADS, "index_dim": INDEX_DIM}
    for ratio in (1, 2):
        out[f"m{ratio}"] = _layer(ratio, dev)
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(bench(torch.device("cuda", 0)), indent=1))
