"""The planner's per-rank state memory (trainer/plan.py) against the tensors a real optimizer step
leaves behind: weights, gradients (Engram tables' sparse rows included) and optimizer state."""
import pytest
import torch

from conf.model import TinyModelConfig
from conf.optim import MuonConfig
from model.transformer import Transformer
from optim import CompositeOptimizer, build_optimizer, route_parameters
from trainer.plan import Layout, state_bytes


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state(opt: CompositeOptimizer) -> int:
    return _bytes(t for inner in opt.optimizers.values() for s in inner.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0)


def _backward(model, micro_batch: int, seq_len: int) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (micro_batch, seq_len + 1), generator=g)
    model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = Transformer(TinyModelConfig(vocab_size=97))
    with torch.device("meta"):
        meta = Transformer(TinyModelConfig(vocab_size=97))
    return model, meta


def test_one_rank_holds_what_the_planner_says(tiny):
    model, meta = tiny
    opt = build_optimizer(model, MuonConfig(), zero_stage=0)
    assert opt.enable_sparse_table_grads(model) > 0
    model.zero_grad(set_to_none=True)
    _backward(model, micro_batch=2, seq_len=64)
    sparse = [p.grad for p in model.parameters() if p.grad is not None and p.grad.is_sparse]
    assert sparse  # the Engram tables' row gradients, as the trainer takes them (not yet coalesced)
    grads = _bytes(p.grad for p in model.parameters() if p.grad is not None and not p.grad.is_sparse)
    grads += _bytes(t for g in sparse for t in (g._values(), g._indices()))
    opt.step()
    want = state_bytes(meta, MuonConfig(), Layout(world=1, zero_stage=0, micro_batch=2, seq_len=64))
    assert want == {"parameters": _bytes(model.parameters()), "gradients": grads, "optimizer": _state(opt)}
    model.zero_grad(set_to_none=True)


def test_sharded_state_is_the_fullest_ranks(tiny):
    """trainer.zero_stage=1 over 4 ranks: each rank keeps the state of the parameters it owns;
    the planner gives the largest rank's."""
    model, meta = tiny
    world = 4
    routes = route_parameters(model, MuonConfig())
    per_rank = []
    for rank in range(world):
        model.zero_grad(set_to_none=True)
        _backward(model, micro_batch=1, seq_len=32)
        opt = CompositeOptimizer(routes, MuonConfig(), rank, world, shard=True)
        for inner in opt.optimizers.values():  # the owner's update, without the broadcast
            inner.step()
        per_rank.append(_state(opt))
    model.zero_grad(set_to_none=True)
    want = state_bytes(meta, MuonConfig(), Layout(world=world, zero_stage=1, seq_len=32))["optimizer"]
    assert want == max(per_rank) and sum(per_rank) > want  # the state really is spread
