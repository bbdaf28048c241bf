import json, torch
import torch.nn.functional as F
import model.kernels.rms_norm as rn
from bench.kernel_timing import kernel_ms
g = torch.Generator(device="cuda").manual_seed(0)
res = {}
for D in (1024, 512):
    x = torch.randn(8 * 4096, D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).requires_grad_()
    cot = torch.randn(8 * 4096, D, device="cuda", generator=g).to(torch.bfloat16)
    def ref():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            torch.autograd.grad(F.rms_norm(x, (D,), w.to(x.dtype), 1e-6).to(x.dtype), [x, w], cot)
    res[f"{D}_ref"] = kernel_ms(ref)
    for tile in (1024, 2048, 4096):
        for pps in (2, 4, 8, 16):
            rn.BWD_TILE, rn.BWD_PROGRAMS_PER_SM = tile, pps
            def ker():
                torch.autograd.grad(rn._rms_norm_kernel(x, w, 1e-6, x.dtype), [x, w], cot)
            res[f"{D}_t{tile}_p{pps}"] = kernel_ms(ker)
    rn.BWD_TILE, rn.BWD_PROGRAMS_PER_SM = 2048, 8
print(json.dumps({k: round(v, 4) for k, v in res.items()}))
