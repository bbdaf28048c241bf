"""Every one-pass config of the sparse attention kernels, timed side by side at `small`'s step shape
(micro-batch 8 x 4096 queries, H = 16, C = 512, k = 512, W = 128, decoder layer: S = 4096).

The autotuner keeps only its pick; this says what each candidate costs, so a config list change
(`model/kernels/sparse_attention.py`: `_FWD_CONFIGS`, `_BWD_CONFIGS`) is judged in one run. Each
config is pinned in turn (the autotuner's list cut to that one) and the kernel's own GPU time is read
from the profiler by kernel name: `_fwd_kernel` with and without p_sum (`fwd`, `fwd_p`; the step has
layers of both kinds) and `_bwd_kernel` (`bwd`; its forward runs at the autotuned pick); `*_best`
is the fastest row.
Only configs whose value chunks cover C (ONE_PASS) are timed: at H = 16 the others lost by 1.5-4x
(sweeps recorded in the module's comments).
"""
from __future__ import annotations

import torch

from bench.kernels.attention_floor import B, C, H, K, T, W, _selection
from bench.timing import kernel_ms


def _label(cfg) -> str:
    kw = cfg.kwargs
    return (f"cv{kw['BLOCK_CV']}x{kw.get('SPLIT', 1)} n{kw['BLOCK_N']} w{cfg.num_warps} st{cfg.num_stages}"
            f" r{cfg.maxnreg}")


def _one_pass(cfg) -> bool:
    return cfg.kwargs["BLOCK_CV"] * cfg.kwargs.get("SPLIT", 1) >= C


def _sweep(tuner, run, name: str, keep) -> list[dict]:
    """Pin each config of `tuner` that `keep` accepts and time kernel `name` under run(); the list is
    restored."""
    configs = list(tuner.configs)
    rows = []
    try:
        for cfg in configs:
            if not keep(cfg):
                continue
            tuner.configs = [cfg]
            tuner.cache.clear()
            try:
                ms = kernel_ms(run, warmup=2, name=name)
            except Exception as e:  # a config that does not build here (shared memory) is a row too
                rows.append({"config": _label(cfg), "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            rows.append({"config": _label(cfg), "ms": ms})
    finally:
        tuner.configs = configs
        tuner.cache.clear()
    return rows


def _best(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if "ms" in r]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def bench(device) -> dict:
    import model.kernels.sparse_attention as sa

    torch.cuda.set_device(device)
    dev = torch.device("cuda", torch.cuda.current_device())
    idx = _selection(T, 1, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    r = lambda *shape: torch.randn(*shape, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    q, win, glob = r(B, T, H, C), r(B, T, C), r(B, T, C)
    sink = torch.zeros(H, device=dev, requires_grad=True)
    doc = torch.zeros(B, T, dtype=torch.long, device=dev)
    dout = torch.randn(B, T, H, C, device=dev, dtype=torch.bfloat16)

    def fwd(want_probs: bool):
        out, _ = sa.sparse_attention_triton(q, win, glob, idx, doc, sink, C ** -0.5, W, want_probs=want_probs)
        return out

    def fwd_bwd():
        torch.autograd.grad(fwd(False), [q, win, glob, sink], dout)

    out = {"micro_batch": B, "queries": T, "heads": H, "latent": C, "topk": K, "window": W, "S": T}
    with torch.no_grad():
        out["fwd"] = _sweep(sa._fwd, lambda: fwd(False), "_fwd_kernel", _one_pass)
        out["fwd_p"] = _sweep(sa._fwd, lambda: fwd(True), "_fwd_kernel", _one_pass)
    out["bwd"] = _sweep(sa._bwd, fwd_bwd, "_bwd_kernel", _one_pass)

    for part in ("fwd", "fwd_p", "bwd"):
        out[f"{part}_best"] = _best(out[part])
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(bench(torch.device("cuda", 0)), indent=1))
