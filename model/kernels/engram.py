"""Triton kernels for the Engram n-gram hash and table gather (docs/ARCHITECTURE.md §5).

References (plain PyTorch, model/engram.py): `Engram._context` (the n ids ending at t, pad_id
before the sequence or inside an earlier document, context-parallel history), `Engram.addresses`
(XOR of id * multiplier products, modulo the head's prime, plus its offset; int64) and
`EngramTable.lookup` (F.embedding of those rows, sparse or dense gradient).

    addr[b, t, l] = (XOR_{i < n_l} id[b, t - i] * mult[i]) mod prime[l] + offset[l]
    rows[b, t, l] = table[addr[b, t, l]]                     l = order * heads + head

* `engram_addresses_triton(...)` -> [B, T, L] int64, bit-exact with `Engram.addresses`.
* `engram_gather_triton(...)` -> [B, T, L, E] rows: the hash kernel writes the addresses (one
  row per thread), then a row kernel copies table rows in tiles of ROW_TILE_BYTES.

Why two kernels, not one: a gather tile spreads each row over a whole warp, and Triton computes
a row's hash in the layout of the tile, i.e. on every lane that holds a piece of the row: 32x the
int64 divisions and id loads of one thread per row (the fused kernel compiled to 128 registers
and ~55 scalar loads per lane for sm_90), which made it issue-bound: 0.53x the reference on an
H200. The addresses are written for the backward anyway and are 8 bytes per
row of 512-1024 bytes, so reading them back costs < 1% of the gather's traffic.

The row kernel (`_rows_kernel`, also the backward's scatter-add and row put): a program owns
BLOCK_R rows x the row width, so each lane moves 16-byte vectors and has all its loads in flight
before its stores (random rows need many bytes in flight). Row offsets are int64 (a 49 GB table
has more than 2^31 elements), per row only; column offsets are int32 and the row width is a
compile-time constant, so a power-of-two width has no column mask and rows are masked only when
N is not a multiple of BLOCK_R. Table loads are evict_first: a row is read once.

The Engram's multipliers [max_n] (one per lookback, shared by orders and heads) are spread on the
host into a [lookups, max_n] matrix whose row for order n holds mult[:n] and zeros after, so every
lookup runs the same max_n-step XOR loop (x ^ 0 = x) and orders need not be compile-time
constants. Magnitudes: the multipliers are odd and below 2^63 / compressed vocab (~2^53 for a
1000-id vocab, ~2^47 for ~100k), so an in-range id times one stays below 2^63: products come
close to it but never wrap, and the XOR of non-negative int64s is non-negative. The modulo is
still made floor-style (a negative C-style remainder lies in (-prime, 0), so adding the prime
cannot overflow), so that out-of-range ids, whose products do wrap, also match torch's `%`. The hash kernel's
index arithmetic (flat row -> b, t, lookup; id offsets) is int32 unless an offset can reach 2^31 (IDX64).

Where the table lives:
* on the ids' device: the hash kernel, then the row kernel.
* in host memory, `host_path="staged"` (default): the kernel computes the addresses on the
  GPU; they are copied into pinned memory (the stream is synchronised, since the CPU reads them
  next), the CPU gathers the rows with index_select into a pinned staging buffer, and a
  non_blocking copy brings them to the GPU (the caching host allocator keeps the staging buffer
  alive until that copy is done). It blocks the host like the reference's `.to(cpu)` does; the
  addresses depend on the ids only, so a caller can run this ahead of the model (prefetch).
* in pinned host memory, `host_path="uva"`: the row kernel reads the table through its mapped
  address. Triton's launcher turns any pointer into its device address with
  cuPointerGetAttribute(DEVICE_POINTER), which succeeds for memory from cudaHostAlloc (PyTorch's
  pin_memory under UVA, the 64-bit Linux default); rows then travel over PCIe/C2C inside the
  kernel, with no host sync. Not verified on a GPU here; bench/kernels/engram.py measures it and
  falls back to reporting the error.

Backward: the gradient of the table is what F.embedding(addresses, weight, sparse=sparse_grad)
gives, on the table's device like the reference (whose rows.to() moves the gradient back there):
* sparse: an uncoalesced COO tensor with indices addr.view(1, -1) and values grad.view(-1, E),
  built without a kernel (the same tensors embedding's sparse backward builds).
* dense, fp32 (fp64) table: grad rows scatter-added with fp32 (fp64) atomics into the zeroed
  gradient (the row kernel with ADD).
* dense, narrower table (bf16, fp16): the touched rows are made unique (torch.unique), their
  sums accumulated in fp32 in a compact [unique, E] buffer, each sum rounded once and put into
  the zeroed gradient (the row kernel scattering). A full-size fp32 buffer would be 2x the table
  and need a cast pass over all of it.
* host table outside the interpreter: index_add_ on the CPU.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import triton
import triton.language as tl

INTERPRET = bool(triton.knobs.runtime.interpret)

# Tunables (scratch/engram_sweep.py sweeps them on a GPU). No autotune: the interpreter lacks it.
# rows per hash program: 4 warps x 32 lanes x 2 rows (~44 registers for sm_90; 8 rows take 154)
HASH_BLOCK = 256
HASH_WARPS = 4
ROW_TILE_BYTES = 16384  # table bytes per row-kernel program: 32 bf16 / 16 fp32 rows of 256
ROW_WARPS = 4  # 128 lanes x 8 16-byte vectors each in flight
MAX_BLOCK_E = 1024  # widest column chunk; wider rows loop over chunks


@triton.jit
def _hash_kernel(ids_ptr, doc_ptr, pos_ptr, hist_ptr, mult_ptr, prime_ptr, off_ptr, addr_ptr,
                 N, T, L, HLEN, pad_id,
                 sib, sit, sdb, sdt, spb, spt, shb, sht,
                 MAX_N: tl.constexpr, HAS_DOC: tl.constexpr, HAS_POS: tl.constexpr, HAS_HIST: tl.constexpr,
                 IDX64: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if IDX64:  # int32 divisions below are several times cheaper than int64 ones
        pid = pid.to(tl.int64)
    r = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat (b, t, l), one per thread
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
    acc = tl.zeros((BLOCK,), dtype=tl.int64)
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
        acc = acc ^ (gram * mult)  # < 2^63 for ids below the compressed vocab (module docstring)
    prime = tl.load(prime_ptr + lk, mask=r_ok, other=1)
    off = tl.load(off_ptr + lk, mask=r_ok, other=0)
    rem = acc % prime  # C-style remainder: sign of acc
    addr = tl.where(rem < 0, rem + prime, rem) + off  # floor-style, like torch's %
    tl.store(addr_ptr + r, addr, mask=r_ok)


@triton.jit
def _rows_kernel(src_ptr, dst_ptr, idx_ptr, N, s_row, s_col,
                 E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, MASKED: tl.constexpr,
                 SCATTER: tl.constexpr, ADD: tl.constexpr):
    # gather:            dst[r, :] = src[idx[r], :]
    # SCATTER:           dst[idx[r], :] = src[r, :]      (idx unique)
    # SCATTER and ADD:   dst[idx[r], :] += src[r, :]     (atomics; idx may repeat)
    # The indexed side has strides (s_row, s_col), the other side is contiguous [N, E]; values
    # are cast to dst's dtype.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    if MASKED:
        r_ok = r < N
        idx = tl.load(idx_ptr + r, mask=r_ok, other=0)
    else:
        idx = tl.load(idx_ptr + r)
    far = idx.to(tl.int64)[:, None] * s_row  # [BR, 1] int64: addr * E passes 2^31 past 8M rows of 256
    near = r[:, None] * E  # [BR, 1] int64
    for e0 in tl.static_range(0, E, BLOCK_E):  # one chunk when E <= MAX_BLOCK_E
        cols = e0 + tl.arange(0, BLOCK_E)[None, :]  # [1, BE] int32
        if SCATTER:
            src, dst = src_ptr + near + cols, dst_ptr + far + cols * s_col
        else:
            src, dst = src_ptr + far + cols * s_col, dst_ptr + near + cols
        if MASKED:
            ok = r_ok[:, None] & (cols < E)  # [BR, BE]
            vals = tl.load(src, mask=ok, other=0, eviction_policy="evict_first").to(dst_ptr.dtype.element_ty)
            if ADD:
                tl.atomic_add(dst, vals, mask=ok, sem="relaxed")
            else:
                tl.store(dst, vals, mask=ok)
        else:
            vals = tl.load(src, eviction_policy="evict_first").to(dst_ptr.dtype.element_ty)
            if ADD:
                tl.atomic_add(dst, vals, sem="relaxed")
            else:
                tl.store(dst, vals)


def _copy_rows(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor, scatter: bool = False,
               add: bool = False,
               block_r: Optional[int] = None, num_warps: Optional[int] = None) -> torch.Tensor:
    """The row kernel: gather dst[r] = src[idx[r]] (src any strides, dst contiguous [N, E]), or
    with scatter dst[idx[r]] = src[r] (+= with add; src contiguous [N, E]). idx [N] int.
    block_r / num_warps override the ROW_TILE_BYTES / ROW_WARPS defaults. Returns dst."""
    table, lined = (dst, src) if scatter else (src, dst)
    N, E = idx.numel(), table.shape[1]
    if N == 0 or E == 0:
        return dst
    if not lined.is_contiguous() or lined.shape != (N, E) or not idx.is_contiguous():
        raise ValueError(f"rows {tuple(lined.shape)} must be contiguous [{N}, {E}], idx contiguous")
    # interpreter: exercise the chunk loop
    block_e = min(triton.next_power_of_2(E), 64 if INTERPRET else MAX_BLOCK_E)
    if block_r is None:
        width = max(src.element_size(), dst.element_size())
        block_r = max(1, ROW_TILE_BYTES // (block_e * width))
        block_r = min(block_r, 32) if INTERPRET else block_r
    block_r = min(triton.next_power_of_2(block_r), triton.next_power_of_2(N))
    masked = N % block_r != 0 or E % block_e != 0
    _rows_kernel[(triton.cdiv(N, block_r),)](
        src, dst, idx, N, table.stride(0), table.stride(1),
        E=E, BLOCK_R=block_r, BLOCK_E=block_e, MASKED=masked, SCATTER=scatter, ADD=add,
        num_warps=num_warps or ROW_WARPS)
    return dst


def effective_multipliers(multipliers: torch.Tensor, orders: Sequence[int], heads: int) -> torch.Tensor:
    """multipliers [max_n] (Engram's buffer) -> [len(orders) * heads, max_n] int64: the row of
    lookup (order n, head) is multipliers[:n], then zeros (x ^ (id * 0) = x drops those slots)."""
    max_n = multipliers.shape[0]
    mult = multipliers.to(torch.int64).view(1, 1, max_n).repeat(len(orders), heads, 1)  # [O, H, max_n]
    for o, n in enumerate(orders):  # fills of slices: a host-made mask would be a copy that waits for the GPU
        mult[o, :, n:] = 0
    return mult.reshape(len(orders) * heads, max_n)


def _extent(t: Optional[torch.Tensor]) -> int:
    """One past the largest element offset of t (0 when absent)."""
    if t is None or t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))


def _launch(lookup_ids, mult, primes, offsets, doc_start, positions, history, pad_id, table=None,
            block_r: Optional[int] = None, num_warps: Optional[int] = None):
    """Addresses [B, T, L] int64 and, with a table, rows [B, T, L, E] (table dtype), on the ids'
    device. block_r / num_warps: the row kernel's tile (defaults from ROW_TILE_BYTES, ROW_WARPS)."""
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
    rows = torch.empty(B, T, L, E, dtype=table.dtype, device=dev) if table is not None else None
    N = B * T * L
    if N == 0:
        return addr, rows
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
    # int32 indices unless an offset (the last program's masked rows included) can reach 2^31
    idx64 = max(N + HASH_BLOCK, *(_extent(t) for t in (lookup_ids, doc_start, positions, history))) >= 2**31
    _hash_kernel[(triton.cdiv(N, HASH_BLOCK),)](
        lookup_ids, doc_start if doc_start is not None else dummy,
        positions if positions is not None else dummy,
        history if history is not None else dummy, mult, primes, offsets, addr,
        N, T, L, history.shape[1] if history is not None else 0, int(pad_id),
        *lookup_ids.stride(), *(doc_start.stride() if doc_start is not None else (0, 0)),
        *(positions.stride() if positions is not None else (0, 0)),
        *(history.stride() if history is not None else (0, 0)),
        MAX_N=max_n, HAS_DOC=doc_start is not None, HAS_POS=positions is not None,
        HAS_HIST=history is not None, IDX64=idx64, BLOCK=HASH_BLOCK, num_warps=HASH_WARPS)
    if table is not None:
        _copy_rows(table, addr.view(N), rows.view(N, E), block_r=block_r, num_warps=num_warps)
    return addr, rows


def engram_addresses_triton(lookup_ids: torch.Tensor, multipliers: torch.Tensor, orders: Sequence[int],
                            primes: torch.Tensor, offsets: torch.Tensor,
                            doc_start: Optional[torch.Tensor] = None,
                            positions: Optional[torch.Tensor] = None, history: Optional[torch.Tensor] = None,
                            pad_id: int = 0) -> torch.Tensor:
    """`Engram.addresses`: lookup_ids [B, T] int, multipliers [max_n], primes/offsets [O*H],
    doc_start [B, T], positions [T] or [B, T], history [B, >= max_n-1] -> [B, T, O*H] int64."""
    mult = effective_multipliers(multipliers, orders, primes.numel() // len(orders))
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
    g, flat = g.contiguous(), flat.contiguous()
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # sums in fp32 at least
    if dtype == acc_dtype:  # atomics straight into the gradient
        return _copy_rows(g, flat, torch.zeros(shape, dtype=dtype, device=device), scatter=True, add=True)
    # narrower table: sum the touched rows in a compact fp32 buffer [U, E], round each sum once
    # (in torch: round to nearest even; the interpreter's casts truncate), put the rows in place
    uniq, inverse = torch.unique(flat, return_inverse=True)  # [U], [N]
    sums = _copy_rows(g, inverse, torch.zeros(uniq.numel(), E, dtype=acc_dtype, device=device), scatter=True,
                      add=True)
    return _copy_rows(sums.to(dtype), uniq, torch.zeros(shape, dtype=dtype, device=device), scatter=True)


class _EngramGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, lookup_ids, mult, primes, offsets, doc_start, positions, history, pad_id,
                sparse, host_path):
        on_ids_device = weight.device == lookup_ids.device
        if on_ids_device or host_path == "uva":
            if not on_ids_device and not weight.is_pinned():
                raise ValueError("host_path='uva' needs a table in pinned host memory")
            addr, rows = _launch(lookup_ids, mult, primes, offsets, doc_start, positions, history, pad_id,
                                 weight)
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
    Differentiable in `table` (dense or, with sparse_grad, sparse COO gradient). multipliers [max_n]."""
    mult = effective_multipliers(multipliers, orders, primes.numel() // len(orders))
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
                                pad_id=engram.pad_id, sparse_grad=engram.table.sparse_grad,
                                host_path=host_path)
