"""Lightning-indexer kernels (model/kernels/indexer.py) vs their references (model/indexer.py).

Per context size S (16K and 128K compressed entries), T = 4096 queries, H = 64 heads, Di = 128,
bf16 q and k, fp32 head weights:

* dense scores, `index_scores_triton` vs `index_scores`: ms, useful TFLOP/s (2*T*H*S*Di) and
  its fraction of the measured bf16 matmul throughput; also the fused causal-mask variant
  (queries are the last T positions, m = 1) and the eager mask it replaces;
* top-k: torch.topk (k = 512) and `select_topk` on those scores, and `select_topk_triton`
  (model/kernels/topk.py) where S <= its MAX_S (16K; wider rows take `select_topk`); also at the
  `small` training shape (8 x 4096 queries over S = 2048 and 4096 entries, k = 512), with the
  ids checked equal; `candidate_pool` (block 8, 2048 blocks) stays in PyTorch;
* Reindex, `index_scores_at_triton` vs `index_scores_at` on a pool of P = 2048 blocks * 8 =
  16384 candidates per query: its time should not depend on S (pool-bounded);
* the indexer KL's use, forward + backward of the scores at P = 512 selected entries.

Every entry catches CUDA OOM on its own (value NaN and a `<key>_oom: 1` marker).

    python -m bench.kernels.indexer
"""
from __future__ import annotations

import json

import torch

from bench.timing import matmul_tflops, timed_into
from model.indexer import candidate_pool, index_scores, index_scores_at, select_topk
from model.kernels.indexer import index_scores_at_triton, index_scores_triton
from model.kernels.topk import MAX_S, select_topk_triton


def _pool_ids(T: int, S: int, blocks: int, block: int, device) -> torch.Tensor:
    """[1, T, blocks*block] sorted entry ids: `blocks` random whole blocks per query (a pool's shape)."""
    nb = S // block
    chosen = torch.rand(T, nb, device=device).topk(min(blocks, nb), dim=-1).indices.sort(-1).values
    ids = (chosen.unsqueeze(-1) * block + torch.arange(block, device=device)).flatten(-2)
    return ids.unsqueeze(0)


def _bench_context(S: int, T: int, H: int, Di: int, pool_blocks: int, pool_block: int, topk: int,
                   peak: float, device, ref_reps: int) -> dict:
    out: dict = {}
    q = torch.randn(1, T, H, Di, device=device, dtype=torch.bfloat16)
    w = torch.randn(1, T, H, device=device) * (Di ** -0.5 * H ** -0.5)
    k = torch.randn(1, S, Di, device=device, dtype=torch.bfloat16)
    flops = 2 * T * H * S * Di
    positions = torch.arange(S - T, S, device=device).unsqueeze(0)  # the last T queries, m = 1
    doc_start = torch.zeros_like(positions)
    with torch.no_grad():
        ms = timed_into(out, "dense_triton_ms", lambda: index_scores_triton(q, w, k))
        out["dense_triton_tflops"] = flops / ms / 1e9
        out["dense_triton_frac_matmul"] = out["dense_triton_tflops"] / peak
        timed_into(out, "dense_triton_masked_ms",
                 lambda: index_scores_triton(q, w, k, positions=positions, doc_start=doc_start, m=1))
        ms = timed_into(out, "dense_ref_ms", lambda: index_scores(q, w, k), reps=ref_reps, warmup=1)
        out["dense_ref_tflops"] = flops / ms / 1e9
        out["dense_speedup"] = out["dense_ref_ms"] / out["dense_triton_ms"]

        j = torch.arange(S, device=device)
        visible = (j + 1 <= positions.unsqueeze(-1) + 1) & (j >= doc_start.unsqueeze(-1))  # rt.visible(1)
        timed_into(out, "dense_ref_masked_ms",
                 lambda: index_scores(q, w, k).masked_fill(~visible, float("-inf")), reps=ref_reps, warmup=1)

        try:
            scores = index_scores_triton(q, w, k, positions=positions, doc_start=doc_start, m=1)
        except torch.OutOfMemoryError:
            scores = None
            out["scores_oom"] = 1
        if scores is not None:
            timed_into(out, "torch_topk_ms", lambda: torch.topk(scores, topk, dim=-1))
            timed_into(out, "select_topk_ms", lambda: select_topk(scores, topk))
            if S <= MAX_S:
                timed_into(out, "select_topk_triton_ms", lambda: select_topk_triton(scores, topk))
                out["select_topk_speedup"] = out["select_topk_ms"] / out["select_topk_triton_ms"]
            newest = positions.clone()  # m = 1, one document: the query's own entry
            timed_into(out, "candidate_pool_ms",
                       lambda: candidate_pool(scores, newest, pool_block, pool_blocks),
                     reps=5, warmup=1)
            del scores
        torch.cuda.empty_cache()

        try:
            cand = _pool_ids(T, S, pool_blocks, pool_block, device)
        except torch.OutOfMemoryError:
            cand = None
            out["reindex_pool_oom"] = 1
        if cand is not None:
            P = cand.shape[-1]
            out["reindex_candidates"] = P
            ms = timed_into(out, "reindex_triton_ms", lambda: index_scores_at_triton(q, w, k, cand))
            out["reindex_triton_tflops"] = 2 * T * H * P * Di / ms / 1e9
            out["reindex_triton_key_gbs"] = T * P * Di * k.element_size() / ms / 1e6  # gathered key bytes
            timed_into(out, "reindex_ref_ms", lambda: index_scores_at(q, w, k, cand), reps=ref_reps, warmup=1)
            out["reindex_speedup"] = out["reindex_ref_ms"] / out["reindex_triton_ms"]
            del cand
        torch.cuda.empty_cache()

    # the indexer KL: scores at the selected top-k entries, forward + backward into q, w, k
    try:
        sel = _pool_ids(T, S, topk, 1, device)
    except torch.OutOfMemoryError:
        out["kl_ids_oom"] = 1
        return out
    leaves = [t.detach().clone().requires_grad_() for t in (q, w, k)]
    up = torch.randn(1, T, sel.shape[-1], device=device)

    def fwd_bwd(fn):
        torch.autograd.grad((fn(*leaves, sel) * up).sum(), leaves)

    timed_into(out, "kl_fwd_bwd_triton_ms", lambda: fwd_bwd(index_scores_at_triton))
    timed_into(out, "kl_fwd_bwd_ref_ms", lambda: fwd_bwd(index_scores_at), reps=ref_reps, warmup=1)
    out["kl_fwd_bwd_speedup"] = out["kl_fwd_bwd_ref_ms"] / out["kl_fwd_bwd_triton_ms"]
    return out


def _select_training_shape(topk: int, device) -> dict:
    """Top-k at the `small` step's shape: micro-batch 8 x 4096 queries, causal ReLU-like scores
    (many exact zeros) over S = 2048 (encoder, m = 2) and 4096 (decoder, m = 1) entries."""
    out = {}
    B, T = 8, 4096
    for S in (2048, 4096):
        t = torch.arange(T, device=device)
        visible = torch.arange(S, device=device)[None, :] <= (t * S // T)[:, None]
        scores = torch.randn(B, T, S, device=device).relu().masked_fill(~visible, float("-inf"))
        ref = timed_into(out, f"s{S}_select_topk_ms", lambda sc=scores: select_topk(sc, topk))
        got = timed_into(out, f"s{S}_select_topk_triton_ms", lambda sc=scores: select_topk_triton(sc, topk))
        out[f"s{S}_select_topk_speedup"] = ref / got
        out[f"s{S}_select_ids_equal"] = bool(torch.equal(select_topk(scores, topk),
                                                         select_topk_triton(scores, topk)))
    return out


def bench(device, T: int = 4096, contexts: tuple[int, ...] = (16384, 131072), H: int = 64, Di: int = 128,
          pool_blocks: int = 2048, pool_block: int = 8, topk: int = 512, ref_reps: int = 5) -> dict:
    """A flat dict of numbers, keys prefixed s{S}_: times in ms, TFLOP/s, fractions, speedups."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError("bench.kernels.indexer needs a CUDA device")
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    peak = matmul_tflops()
    out = {"queries": T, "heads": H, "index_dim": Di, "matmul_tflops": peak, "topk": topk,
           "pool_candidates": pool_blocks * pool_block}
    out.update({f"train_{k}": v for k, v in _select_training_shape(topk, device).items()})
    for S in contexts:
        out.update({f"s{S}_{k}": v
                    for k, v in _bench_context(S, T, H, Di, pool_blocks, pool_block, topk, peak,
                                               device, ref_reps).items()})
        torch.cuda.empty_cache()
    if len(contexts) >= 2:  # pool-bounded: ~1.0 whatever the context grows by
        lo, hi = contexts[0], contexts[-1]
        nan = float("nan")
        out["reindex_time_ratio_long_vs_short"] = (out.get(f"s{hi}_reindex_triton_ms", nan)
                                                   / out.get(f"s{lo}_reindex_triton_ms", nan))
    return out


if __name__ == "__main__":
    print(json.dumps(bench(torch.device("cuda")), indent=1))
