"""Per-expert counts of routed ids on CUDA, the ways torch offers, in GPU time a call: the MoE
counts experts twice a layer (`model.moe.expert_counts`: the dispatch and the router's load).
Each way but bincount runs 50 calls in one CUDA graph (so host launch time does not count);
bincount cannot be captured (it reads its input's max and min back to the host) and is timed
eagerly, that wait included. Each result is checked against bincount first.

    python -m bench.experiments.expert_counts   (prints JSON; CUDA only)
"""
from __future__ import annotations

import datetime
import json

import torch

from bench import provenance
from model.moe import expert_counts

# (experts, ids): `small`'s 32 experts x 4 choices x 32768 tokens, `flash`'s 384 x 6 x 32768, `tiny`
SHAPES = ((32, 131072), (384, 196608), (8, 4096))


def _ways(ids: torch.Tensor, n: int) -> dict:
    dev = ids.device
    return {
        "scatter_add": lambda: torch.zeros(n, dtype=torch.int64,
                                           device=dev).scatter_add_(0, ids, torch.ones_like(ids)),
        "histc": lambda: torch.histc(ids.float(), bins=n, min=0, max=n).long(),
        "sort_searchsorted": lambda: torch.searchsorted(ids.sort().values,
                                                        torch.arange(n + 1, device=dev)).diff(),
        "compare_sum": lambda: (ids.unsqueeze(1) == torch.arange(n, device=dev)).sum(0),
        "expert_counts": lambda: expert_counts(ids, n),
        "bincount": lambda: torch.bincount(ids, minlength=n),
    }


def _us_per_call(fn, graph: bool, calls: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        start.record()
        g.replay()
    else:
        start.record()
        for _ in range(calls):
            fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1000


def main() -> dict:
    import triton

    commit = provenance.commit()
    result = {"bench": "expert_counts", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": triton.__version__, "date": datetime.date.today().isoformat(), "commit": commit,
              "us_per_call": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, m in SHAPES:
        ids = torch.randint(0, n, (m,), device="cuda", generator=gen)
        want = torch.bincount(ids, minlength=n)
        row = {}
        for name, fn in _ways(ids, n).items():
            if not torch.equal(fn(), want):
                raise SystemExit(f"bench.experiments.expert_counts: {name} miscounts at {n} experts, {m} ids")
            row[name] = round(_us_per_call(fn, graph=name != "bincount"), 2)
        result["us_per_call"][f"{n}_experts_{m}_ids"] = row
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
