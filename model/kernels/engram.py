"""Triton kernel for the Engram n-gram hash and table gather (SPEC §5).

References (plain PyTorch, model/engram.py): `Engram._context` (the n ids ending at t, pad_id
before the sequence or inside an earlier document, context-parallel history), `Engram.addresses`
(XOR of id * multiplier products, modulo the head's prime, plus its offset; int64) and
`EngramTable.lookup` (F.embedding of those rows, sparse or dense gradient).

    addr[b, t, l] = (XOR_{i < n_l} id[b, t - i] * mult[l, i]) mod prime[l] + offset[l]
    rows[b, t, l] = table[addr[b, t, l]]                     l = order * heads + head

* `engram_addresses_triton(...)` -> [B, T, L] int64, bit-exact with `Engram.addresses`.
* `engram_gather_triton(...)` -> [B, T, L, E] rows: one kernel hashes and gathers, so the
  addresses never go through memory before the gather (they are written once, for the backward).
  Each program owns BLOCK_R (token, lookup) rows: it recomputes its tokens' n-grams (a few cached
  int64 loads), hashes, then copies the table rows in BLOCK_E column chunks.

Unused multiplier slots (i >= n for order n) are zeroed on the host, so every lookup runs the
same max_n-step XOR loop (x ^ 0 = x) and orders need not be compile-time constants. The modulo
is made floor-style (the remainder is moved into [0, prime)) so even wrapped int64 products
match torch's `%`; with ids < 2^20 and multipliers < 2^31 nothing wraps.

Where the table lives:
* on the ids' device: the fused kernel.
* in host memory, `host_path="staged"` (default): the kernel computes the addresses on the
  GPU; they are copied into pinned memory (the stream is synchronised, since the CPU reads them
  next), the CPU gathers the rows with index_select into a pinned staging buffer, and a
  non_blocking copy brings them to the GPU (the caching host allocator keeps the staging buffer
  alive until that copy is done). It blocks the host like the reference's `.to(cpu)` does; the
  addresses depend on the ids only, so a caller can run this ahead of the model (prefetch).
* in pinned host memory, `host_path="uva"`: the fused kernel reads the table through its mapped
  address. Triton's launcher turns any pointer into its device address with
  cuPointerGetAttribute(DEVICE_POINTER), which succeeds for memory from cudaHostAlloc (PyTorch's
  pin_memory under UVA, the 64-bit Linux default); rows then travel over PCIe/C2C inside the
  kernel, with no host sync. Not verified on a GPU here; bench/kernels_engram.py measures it and
  falls back to reporting the error.

Backward: the gradient of the table is what F.embedding(addresses, weight, sparse=sparse_grad)
gives: dense, grad rows scatter-added (a Triton fp32 atomic kernel on a GPU table; index_add_
for a host table), or an uncoalesced sparse COO tensor with indices addr.view(1, -1) and values
grad.view(-1, E). Either way on the table's device, like the reference, whose rows.to() moves
the gradient back there.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import triton
import triton.language as tl

INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _engram_kernel(ids_ptr, doc_ptr, pos_ptr, hist_ptr, mult_ptr, prime_ptr, off_ptr, table_ptr, addr_ptr, out_ptr,
                   N, T, L, E, HLEN, pad_id,
                   sib, sit, sdb, sdt, spb, spt, shb, sht, str_, ste,
                   MAX_N: tl.constexpr, HAS_DOC: tl.constexpr, HAS_POS: tl.constexpr, HAS_HIST: tl.constexpr,
                   GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] flat (b, t, l)
    r_ok = r < N
    tok = r // L
    lk = r % L  # lookup = order * heads + head
    b, t = tok // T, tok % T
    if HAS_POS:
        pos = tl.load(pos_ptr + b * spb + t * spt, mask=r_ok, other=0)  # global position
    else:
        pos = t
    if HAS_DOC:
        doc = tl.load(doc_ptr + b * sdb + t * sdt, mask=r_ok, other=0)
    acc = tl.zeros((BLOCK_R,), dtype=tl.int64)
    for i in tl.static_range(MAX_N):
        src = t - i  # the id at t - i
        in_seq = src >= 0
        gram = tl.load(ids_ptr + b * sib + src * sit, mask=r_ok & in_seq, other=0).to(tl.int64)
        if HAS_HIST:  # before the slice: history[:, HLEN + (t - i)]
            before = tl.load(hist_ptr + b * shb + (HLEN + src) * sht, mask=r_ok & (src < 0), other=0)
            gram = tl.where(in_seq, gram, before.to(tl.int64))
        else:  # before the sequence: pad
            gram = tl.where(in_seq, gram, pad_id)
        if HAS_DOC:  # inside an earlier document: pad
            gram = tl.where(pos - i < doc, pad_id, gram)
        mult = tl.load(mult_ptr + lk * MAX_N + i, mask=r_ok, other=0)  # 0 for i >= the order
        acc = acc ^ (gram * mult)
    prime = tl.load(prime_ptr + lk, mask=r_ok, other=1)
    off = tl.load(off_ptr + lk, mask=r_ok, other=0)
    rem = acc % prime  # C-style remainder: sign of acc
    addr = tl.where(rem < 0, rem + prime, rem) + off  # floor-style, like torch's %
    tl.store(addr_ptr + r, addr, mask=r_ok)
    if GATHER:
        src_row = table_ptr + addr[:, None] * str_  # [BR, 1]
        dst_row = out_ptr + r[:, None] * E  # out: contiguous [N, E]
        for e0 in range(0, E, BLOCK_E):
            offs_e = e0 + tl.arange(0, BLOCK_E)
            ok = r_ok[:, None] & (offs_e < E)[None, :]
            vals = tl.load(src_row + offs_e[None, :] * ste, mask=ok)
            tl.store(dst_row + offs_e[None, :], vals, mask=ok)


@triton.jit
def _scatter_add_kernel(grad_ptr, addr_ptr, dst_ptr, N, E,
                        BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    # dst[addr[r], :] += grad[r, :]; grad contiguous [N, E], dst contiguous fp32 [rows, E]
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < N
    addr = tl.load(addr_ptr + r, mask=r_ok, other=0)
    for e0 in range(0, E, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        ok = r_ok[:, None] & (offs_e < E)[None, :]
        g = tl.load(grad_ptr + r[:, None] * E + offs_e[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.atomic_add(dst_ptr + addr[:, None] * E + offs_e[None, :], g, mask=ok, sem="relaxed")


def _blocks(E: int) -> dict:
    block_e = min(triton.next_power_of_2(max(E, 1)), 256)
    if INTERPRET:
        return {"BLOCK_R": 32, "BLOCK_E": min(block_e, 16)}
    # 32 rows of up to 256 columns: 8K elements per chunk, 1 KB contiguous per fp32 row
    return {"BLOCK_R": 32, "BLOCK_E": block_e, "num_warps": 8}


def effective_multipliers(multipliers: torch.Tensor, orders: Sequence[int]) -> torch.Tensor:
    """multipliers [O, H, max_n] (Engram's buffer) -> [O*H, max_n] int64 with the slots i >= n of
    order n zeroed (x ^ (id * 0) = x, so they drop out of the XOR)."""
    n_orders, heads, max_n = multipliers.shape
    n = torch.tensor(list(orders), device=multipliers.device).view(n_orders, 1, 1)
    used = torch.arange(max_n, device=multipliers.device) < n  # [O, 1, max_n]
    return torch.where(used, multipliers, torch.zeros_like(multipliers)).reshape(n_orders * heads, max_n).long().contiguous()


def _launch(lookup_ids, mult, primes, offsets, doc_start, positions, history, pad_id, table=None):
    """Addresses [B, T, L] int64 and, with a table, rows [B, T, L, E] (table dtype), on the ids' device."""
    if lookup_ids.dim() != 2:
        raise ValueError(f"lookup_ids must be [B, T], got {tuple(lookup_ids.shape)}")
    B, T = lookup_ids.shape
    dev = lookup_ids.device
    L, max_n = mult.shape
    mult = mult.to(dev)
    primes = primes.to(dev, torch.int64).contiguous()
    offsets = offsets.to(dev, torch.int64).contiguous()
    if primes.numel() != L or offsets.numel() != L:
        raise ValueError(f"{L} lookups but {primes.numel()} primes and {offsets.numel()} offsets")
    addr = torch.empty(B, T, L, dtype=torch.int64, device=dev)
    E = table.shape[1] if table is not None else 1
    rows = torch.empty(B, T, L, E, dtype=table.dtype, device=dev) if table is not None else addr
    N = B * T * L
    if N == 0:
        return addr, (rows if table is not None else None)
    dummy = addr  # pointer for absent optional inputs (never read: the flags are off)
    if doc_start is not None:
        doc_start = doc_start.to(dev, torch.int64).expand(B, T)
    if positions is not None:
        positions = positions.to(dev, torch.int64)
        positions = positions.expand(B, T) if positions.dim() == 2 else positions.view(1, T).expand(B, T)
    keep = max_n - 1
    if history is not None:
        if history.shape[0] != B or history.shape[1] < keep:
            raise ValueError(f"history {tuple(history.shape)} must be [B, >= {keep}]")
        history = history.to(dev)
    blocks = _blocks(E)
    grid = (triton.cdiv(N, blocks["BLOCK_R"]),)
    _engram_kernel[grid](
        lookup_ids, doc_start if doc_start is not None else dummy, positions if positions is not None else dummy,
        history if history is not None else dummy, mult, primes, offsets,
        table if table is not None else dummy, addr, rows,
        N, T, L, E, history.shape[1] if history is not None else 0, int(pad_id),
        *lookup_ids.stride(), *(doc_start.stride() if doc_start is not None else (0, 0)),
        *(positions.stride() if positions is not None else (0, 0)),
        *(history.stride() if history is not None else (0, 0)),
        *(table.stride() if table is not None else (0, 0)),
        MAX_N=max_n, HAS_DOC=doc_start is not None, HAS_POS=positions is not None,
        HAS_HIST=history is not None, GATHER=table is not None, **blocks)
    return addr, (rows if table is not None else None)


def engram_addresses_triton(lookup_ids: torch.Tensor, multipliers: torch.Tensor, orders: Sequence[int],
                            primes: torch.Tensor, offsets: torch.Tensor, doc_start: Optional[torch.Tensor] = None,
                            positions: Optional[torch.Tensor] = None, history: Optional[torch.Tensor] = None,
                            pad_id: int = 0) -> torch.Tensor:
    """`Engram.addresses`: lookup_ids [B, T] int, multipliers [O, H, max_n], primes/offsets [O*H],
    doc_start [B, T], positions [T] or [B, T], history [B, >= max_n-1] -> [B, T, O*H] int64."""
    mult = effective_multipliers(multipliers, orders)
    return _launch(lookup_ids, mult, primes, offsets, doc_start, positions, history, pad_id)[0]


@torch.no_grad()
def host_gather(table: torch.Tensor, addresses: torch.Tensor) -> torch.Tensor:
    """Rows of a host table at addresses [...] (any device) -> [..., E] on the addresses' device,
    through pinned staging buffers when a GPU is involved (see the module docstring)."""
    dev = addresses.device
    flat = addresses.reshape(-1)
    pin = dev.type == "cuda"
    addr_host = torch.empty(flat.shape, dtype=torch.int64, pin_memory=pin)
    addr_host.copy_(flat, non_blocking=pin)
    if pin:
        torch.cuda.current_stream(dev).synchronize()  # the CPU reads addr_host next
    staging = torch.empty(flat.numel(), table.shape[1], dtype=table.dtype, pin_memory=pin)
    torch.index_select(table, 0, addr_host, out=staging)
    return staging.to(dev, non_blocking=pin).view(*addresses.shape, table.shape[1])


def table_grad(shape: torch.Size, device: torch.device, dtype: torch.dtype, addr: torch.Tensor,
               grad: torch.Tensor, sparse: bool) -> torch.Tensor:
    """What F.embedding(addr, weight, sparse=sparse) gives weight.grad (weight of that shape,
    device and dtype) for grad rows [..., E] at addr [...]."""
    E = shape[1]
    flat = addr.reshape(-1).to(device)
    g = grad.reshape(-1, E).to(device, dtype)
    if sparse:
        # uncoalesced, like embedding's; the indices are the kernel's addresses, in range by construction
        return torch.sparse_coo_tensor(flat.view(1, -1), g, shape, check_invariants=False)
    if (device.type == "cpu" and not INTERPRET) or g.shape[0] == 0:  # host table: the CPU adds
        return torch.zeros(shape, dtype=dtype, device=device).index_add_(0, flat, g)
    out = torch.zeros(shape, dtype=torch.float32, device=device)  # fp32 sums whatever the table dtype
    blocks = _blocks(E)
    _scatter_add_kernel[(triton.cdiv(g.shape[0], blocks["BLOCK_R"]),)](
        g.contiguous(), flat.contiguous(), out, g.shape[0], E, **blocks)
    return out if dtype == torch.float32 else out.to(dtype)


class _EngramGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, lookup_ids, mult, primes, offsets, doc_start, positions, history, pad_id,
                sparse, host_path):
        on_ids_device = weight.device == lookup_ids.device
        if on_ids_device or host_path == "uva":
            if not on_ids_device and not weight.is_pinned():
                raise ValueError("host_path='uva' needs a table in pinned host memory")
            addr, rows = _launch(lookup_ids, mult, primes, offsets, doc_start, positions, history, pad_id, weight)
        elif host_path == "staged":
            addr = _launch(lookup_ids, mult, primes, offsets, doc_start, positions, history, pad_id)[0]
            rows = host_gather(weight, addr)
        else:
            raise ValueError(f"host_path={host_path!r}: expected staged or uva")
        ctx.save_for_backward(addr)
        ctx.sparse, ctx.table = sparse, (weight.shape, weight.device, weight.dtype)
        ctx.mark_non_differentiable(addr)
        return rows, addr

    @staticmethod
    def backward(ctx, grad_rows, _grad_addr):
        (addr,) = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0]:
            grad = table_grad(*ctx.table, addr, grad_rows, ctx.sparse)
        return (grad,) + (None,) * 10


def engram_gather_triton(lookup_ids: torch.Tensor, table: torch.Tensor, multipliers: torch.Tensor,
                         orders: Sequence[int], primes: torch.Tensor, offsets: torch.Tensor,
                         doc_start: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                         history: Optional[torch.Tensor] = None, pad_id: int = 0, sparse_grad: bool = False,
                         host_path: str = "staged", return_addresses: bool = False):
    """`EngramTable.lookup(Engram.addresses(...))` in one pass: lookup_ids [B, T], table [rows, E]
    (the EngramTable weight, on the ids' device or in host memory) -> rows [B, T, O*H, E] in the
    table's dtype on the ids' device (and the addresses [B, T, O*H] with return_addresses).
    Differentiable in `table` (dense or, with sparse_grad, sparse COO gradient)."""
    mult = effective_multipliers(multipliers, orders)
    rows, addr = _EngramGather.apply(table, lookup_ids, mult, primes, offsets, doc_start, positions, history,
                                     pad_id, sparse_grad, host_path)
    return (rows, addr) if return_addresses else rows


def engram_lookup_triton(engram, lookup_ids: torch.Tensor, doc_start: Optional[torch.Tensor] = None,
                         positions: Optional[torch.Tensor] = None, history: Optional[torch.Tensor] = None,
                         host_path: str = "staged") -> torch.Tensor:
    """The kernel with a model.engram.Engram's state: same as
    engram.table.lookup(engram.addresses(lookup_ids, doc_start, positions, history))."""
    return engram_gather_triton(lookup_ids, engram.table.weight, engram.multipliers, engram.orders,
                                engram.primes, engram.offsets, doc_start, positions, history,
                                pad_id=engram.pad_id, sparse_grad=engram.table.sparse_grad, host_path=host_path)
