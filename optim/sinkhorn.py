"""Sinkhorn: momentum SGD with a Sinkhorn-balanced update, for embedding, LM-head and Engram tables.

Per 2-D parameter [rows, cols]: Nesterov momentum, then `sinkhorn_balance` of the update U:
  1. rows with L2 norm <= tau * (mean row norm) are zeroed: they carry no signal. The mean is over
     rows with a non-zero norm, so all-zero rows (untouched table rows) do not move the threshold;
     that keeps the dense and the sparse path below identical on the rows a batch touches;
  2. `iters` alternating L2 normalisations, rows first and last (row, col, ..., row): rows end at unit
     norm, columns near-balanced, so no token and no feature dominates the step;
  3. times sqrt(cols): every kept row has RMS 1 (columns then have RMS ~1 too).
The step is p -= lr * gamma * N; gamma = 0.18 matches the update RMS of Muon's "fixed" mode.
One state tensor (`momentum_buffer`) per parameter, against Adam's two.

Sparse row gradients (`F.embedding(..., sparse=True)`, as Engram tables produce): only the touched
rows are read and written, momentum included (lazy, like SparseAdam): an untouched row's momentum
does not decay and it gets no update, so a row that a batch skips does not coast on momentum as it
would with a dense gradient; weight decay, if any, also reaches only touched rows.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from optim.base import CheckedOptimizer


def sinkhorn_balance(U: torch.Tensor, iters: int = 11, tau: float = 1e-3, eps: float = 1e-12,
                     row_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """[rows, cols] -> [rows, cols] (U's dtype, computed in fp32): kept rows RMS 1, columns balanced.

    row_sum: U is one shard of a matrix split by rows over several processes (host Engram tables,
    trainer/engram_host.py); the hook sums a tensor over the shards (an all-reduce), so the
    threshold's mean row norm and every column norm are those of the whole matrix. None: U is whole.

    `iters` must be odd so the last normalisation is over rows. eps keeps zeroed rows and columns at
    zero (0 / eps) instead of NaN; a zero matrix maps to zeros.

    Every pass only rescales rows or columns, so the iterate is always diag(r) U diag(c): the passes
    update the vectors r [rows] and c [cols] from matrix-vector products with the squares Q = U * U
    (a row's norm is r_i sqrt((Q c^2)_i), a column's c_j sqrt((r^2 Q)_j)), and U is scaled once at
    the end. Same arithmetic as normalising the matrix pass by pass (up to fp32 rounding), but each
    pass reads Q once instead of reading and writing the whole matrix twice.
    """
    if U.dim() != 2:
        raise ValueError(f"sinkhorn_balance needs [rows, cols], got shape {tuple(U.shape)}")
    if not isinstance(iters, int) or iters < 1 or iters % 2 == 0:
        raise ValueError(f"iters={iters!r}: expected an odd int >= 1 (rows first and last)")
    X = U.float()
    Q = X * X  # [rows, cols]
    norms = Q.sum(dim=1).sqrt()  # [rows]
    total = torch.stack((norms.sum(), (norms > 0).sum().float()))  # [2]: over non-zero rows only
    if row_sum is not None:
        total = row_sum(total)
    mean = total[0] / total[1].clamp_min(1)
    r = (norms > tau * mean).float()  # [rows]: rows at or below the threshold are zeroed
    c = torch.ones(X.size(1), dtype=torch.float32, device=X.device)  # [cols]
    for i in range(iters):
        # even passes: each row to unit norm; odd passes: each column (fp32 matrix-vector products).
        # A row or column that is all zero stays so whatever its scale, which is then left as it
        # is (dividing it by eps pass after pass would overflow to inf and give 0 * inf = NaN).
        if i % 2 == 0:
            n = r * torch.mv(Q, c * c).sqrt()
            r = torch.where(n > 0, r / (n + eps), r)
        else:
            col = torch.mv(Q.t(), r * r)  # [cols]
            n = c * (col if row_sum is None else row_sum(col)).sqrt()
            c = torch.where(n > 0, c / (n + eps), c)
    return (X * r[:, None] * (c * math.sqrt(X.size(1)))[None, :]).to(U.dtype)


def _check_group(group: dict[str, Any]) -> None:
    """ValueError for a bad option or a parameter that is not a table."""
    if not group["lr"] >= 0.0:
        raise ValueError(f"lr={group['lr']}: expected >= 0")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum={group['momentum']}: expected in [0, 1)")
    if not group["gamma"] > 0.0:
        raise ValueError(f"gamma={group['gamma']}: expected > 0")
    if not isinstance(group["iters"], int) or group["iters"] < 1 or group["iters"] % 2 == 0:
        raise ValueError(f"iters={group['iters']!r}: expected an odd int >= 1 (rows first and last)")
    if not group["tau"] >= 0.0:
        raise ValueError(f"tau={group['tau']}: expected >= 0")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay={group['weight_decay']}: expected >= 0")
    for p in group["params"]:
        if p.dim() != 2:
            raise ValueError(f"Sinkhorn needs 2-D [rows, cols] parameters, got shape {tuple(p.shape)}")


class Sinkhorn(CheckedOptimizer):
    """Sinkhorn-balanced momentum over whole 2-D tables; dense or sparse-COO row gradients.

    Per parameter: buf = momentum * buf + grad; u = grad + momentum * buf (Nesterov) or buf;
    p *= 1 - lr * weight_decay; p -= lr * gamma * sinkhorn_balance(u, iters, tau).
    Group options: lr, momentum, nesterov, gamma, iters, tau, weight_decay.
    """

    check_group = staticmethod(_check_group)

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 momentum: float = 0.95, nesterov: bool = True, gamma: float = 0.18, iters: int = 11,
                 tau: float = 1e-3, weight_decay: float = 0.0):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, gamma=gamma, iters=iters, tau=tau,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if p.grad.is_sparse:
                    self._sparse_step(p, p.grad, state["momentum_buffer"], group)
                else:
                    self._update(p, p.grad, state["momentum_buffer"], group)
        return loss

    @staticmethod
    def _update(w: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, group: dict[str, Any],
                row_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """In place on w [n, cols] and buf [n, cols] given g [n, cols]: the whole step on a row set
        (row_sum: the row set is one shard of the step's rows, see sinkhorn_balance)."""
        mu, lr = group["momentum"], group["lr"]
        buf.mul_(mu).add_(g)
        u = g.add(buf, alpha=mu) if group["nesterov"] else buf
        if group["weight_decay"] != 0.0:
            w.mul_(1.0 - lr * group["weight_decay"])
        return w.add_(sinkhorn_balance(u, group["iters"], group["tau"], row_sum=row_sum),
                      alpha=-lr * group["gamma"])

    def _sparse_step(self, p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor,
                     group: dict[str, Any]) -> None:
        """The dense step restricted to the rows a sparse COO gradient touches; other rows are not read."""
        grad = grad.coalesce()  # F.embedding repeats a row once per lookup; coalescing sums the repeats
        if grad.sparse_dim() != 1:
            raise ValueError(f"sparse gradient with sparse_dim={grad.sparse_dim()}: expected row-sparse (1)")
        rows = grad.indices()[0]  # [n] unique, sorted
        if rows.numel() == 0:
            return
        # gather, update the copies with the dense step's arithmetic, scatter back (rows are unique)
        buf_rows, w_rows = buf.index_select(0, rows), p.index_select(0, rows)  # [n, cols]
        self._update(w_rows, grad.values(), buf_rows, group)
        buf.index_copy_(0, rows, buf_rows)
        p.index_copy_(0, rows, w_rows)
