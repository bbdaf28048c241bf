"""Which optimiser updates which parameter: rules over names and shapes (first match wins)."""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from torch import nn

from conf.errors import ConfigError
from conf.optim import OptimConfig, RouteRule

OPTIMIZERS = ("muon", "sinkhorn", "adamw")

# ARCHITECTURE.md §7: tables (embedding, LM head, Engram) -> Sinkhorn; every other matrix or expert stack
# -> Muon; vectors and scalars (norms, sinks, mHC gains and biases) -> AdamW without decay, and so
# do the Engram gate's per-stream norm weights ([streams, dim], `*_norm_weight`, under either
# optimiser): elementwise scales like any norm weight, not a linear map for Muon to orthogonalise.
DEFAULT_RULES = {
    "muon": [
        RouteRule(pattern=r"(^|\.)(embed|head)\.weight$|\.table\.weight$", optimizer="sinkhorn", min_dim=2),
        RouteRule(pattern=r"_norm_weight$", optimizer="adamw", weight_decay=0.0),
        RouteRule(pattern=r".", optimizer="muon", min_dim=2, max_dim=3),
        RouteRule(pattern=r".", optimizer="adamw", weight_decay=0.0),
    ],
    "adamw": [
        RouteRule(pattern=r"_norm_weight$", optimizer="adamw", weight_decay=0.0),
        RouteRule(pattern=r".", optimizer="adamw", min_dim=2),
        RouteRule(pattern=r".", optimizer="adamw", weight_decay=0.0),
    ],
}


@dataclass(frozen=True)
class Route:
    name: str
    param: nn.Parameter
    optimizer: str
    lr_mult: float
    weight_decay: float
    heads: int  # Muon: rows split into this many per-head matrices

    @property
    def group_key(self) -> tuple:
        return (self.optimizer, self.lr_mult, self.weight_decay, self.heads)


def _default_weight_decay(cfg: OptimConfig, optimizer: str) -> float:
    return {"muon": cfg.muon_weight_decay, "sinkhorn": cfg.sinkhorn_weight_decay,
            "adamw": cfg.weight_decay}[optimizer]


def route_parameters(model: nn.Module, cfg: OptimConfig) -> list[Route]:
    """One Route per trainable parameter, in model order. Head counts come from the model's
    `head_splits()` (projections whose rows are per-head blocks)."""
    if cfg.name not in DEFAULT_RULES:
        raise ConfigError(f"optim.name={cfg.name!r}: expected one of {tuple(DEFAULT_RULES)}")
    rules = list(cfg.rules) or DEFAULT_RULES[cfg.name]
    for rule in rules:
        if rule.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optim.rules: optimizer {rule.optimizer!r} is not one of {OPTIMIZERS}")
    heads = model.head_splits() if hasattr(model, "head_splits") else {}
    routes = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        rule = next((r for r in rules if r.min_dim <= p.dim() <= r.max_dim and re.search(r.pattern, name)),
                    None)
        if rule is None:
            raise ConfigError(f"optim.rules: no rule matches parameter {name} {tuple(p.shape)}")
        wd = _default_weight_decay(cfg, rule.optimizer) if rule.weight_decay is None else rule.weight_decay
        routes.append(Route(name, p, rule.optimizer, rule.lr_mult, wd,
                            heads.get(name, 1) if rule.optimizer == "muon" else 1))
    return routes


def routing_table(routes: list[Route]) -> str:
    """Tensors and parameters per optimiser, for the start-of-run printout."""
    count: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in routes:
        count[r.optimizer][0] += 1
        count[r.optimizer][1] += r.param.numel()
    total = sum(n for _, n in count.values()) or 1
    lines = [f"{'optimizer':<10}{'tensors':>9}{'parameters':>16}{'share':>8}"]
    for opt in OPTIMIZERS:
        if opt in count:
            t, n = count[opt]
            lines.append(f"{opt:<10}{t:>9}{n:>16,}{n / total:>8.1%}")
    return "\n".join(lines)
