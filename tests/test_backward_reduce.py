"""ZeRO-2 for the composite optimiser (trainer/backward_reduce.py): gradients reduced to their owners
during the backward, across micro-batches, equal to the whole batch's."""
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conf.model import TinyModelConfig
from conf.optim import MuonConfig
from model.transformer import Transformer
from optim import build_optimizer

TINY = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50)
MICRO = 2  # micro-batches a rank runs per step


def _batch(sequences: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (sequences, 64), generator=torch.Generator().manual_seed(7))


def _sparse_tables(model: Transformer) -> None:
    for m in model.modules():
        if type(m).__name__ == "EngramTable":
            m.sparse_grad = True  # as the trainer's composite optimiser sets them


def _backward(model: Transformer, batch: torch.Tensor, scale: float) -> None:
    out = model(input_ids=batch, labels=batch)
    ((out.lm_loss + out.balance_loss + out.indexer_loss) * scale).backward()


def _whole_batch_grads(sequences: int) -> tuple[Transformer, float]:
    """One process, the whole batch in one backward (float64): the gradients every layout must give."""
    from trainer.parallelize import build_layout, clip_grad_norm

    torch.manual_seed(0)
    model = Transformer(TINY).double()
    _sparse_tables(model)
    _backward(model, _batch(sequences), 1.0)
    return model, clip_grad_norm(model, build_layout(0, 1, 1, TINY.n_routed_experts), set(), 0.0)


def _zero2_step(model, layout, expert_params, owners, batch: torch.Tensor, grad_dtype=torch.float64):
    """The trainer's step at zero_stage=2: MICRO micro-batches (loss scaled by 1/MICRO, as DeepSpeed's
    accumulation scales it), each reduced during its backward; then the sparse tables and the norm.
    Returns (norm, the largest number of dense-gradient bytes this rank held after a backward)."""
    from trainer.backward_reduce import BackwardReducer
    from trainer.parallelize import clip_grad_norm, reduce_gradients

    reducer = BackwardReducer(model, layout, expert_params, owners, grad_dtype)
    held = 0
    for part in batch.chunk(MICRO):
        _backward(model, part, 1.0 / MICRO)
        reducer.finish_micro_batch()
        left = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                   if p.grad is not None and not p.grad.is_sparse)
        held = max(held, left + reducer.held_bytes())
    reduce_gradients(model, layout, expert_params, owners)
    reducer.finish_step()
    reducer.remove()
    return clip_grad_norm(model, layout, expert_params, 0.0, sharded=bool(owners)), held


def test_one_rank_accumulates_like_autograd_and_holds_no_gradient_between_micro_batches():
    """At one rank the reducer is plain accumulation: the same float64 sums as autograd's own (same
    order of additions, so bitwise), and between micro-batches every dense gradient sits in the
    reducer's buffers, none on the parameters. A parameter the step gave no gradient (the vision tower
    of a text-only step) ends with none, as without the reducer, not with a zero gradient that the
    optimiser would step (momentum, weight decay)."""
    from trainer.backward_reduce import BackwardReducer
    from trainer.parallelize import build_layout

    cfg = dataclasses.replace(TINY, vision_n_layers=1)
    torch.manual_seed(0)
    plain = Transformer(cfg).double()
    _sparse_tables(plain)
    for part in _batch(4).chunk(MICRO):
        _backward(plain, part, 1.0 / MICRO)
    assert any(q.grad is None for q in plain.visual.parameters())
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    _sparse_tables(model)
    layout = build_layout(0, 1, 1, TINY.n_routed_experts)
    reducer = BackwardReducer(model, layout, set(), {}, torch.float64, bucket_bytes=2**16)
    assert len(reducer.buckets) > 3  # several buckets, so their order matters
    for part in _batch(4).chunk(MICRO):
        _backward(model, part, 1.0 / MICRO)
        reducer.finish_micro_batch()
        assert all(p.grad is None or p.grad.is_sparse for p in model.parameters())
    reducer.finish_step()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        elif q.grad.is_sparse:
            assert torch.equal(p.grad.to_dense(), q.grad.to_dense()), name
        else:
            assert torch.equal(p.grad, q.grad), name


def test_bf16_buffers_hold_the_gradient_to_bf16_rounding():
    from trainer.backward_reduce import BackwardReducer
    from trainer.parallelize import build_layout

    reference, _ = _whole_batch_grads(2)
    torch.manual_seed(0)
    model = Transformer(TINY).double()
    _sparse_tables(model)
    reducer = BackwardReducer(model, build_layout(0, 1, 1, TINY.n_routed_experts), set(), {}, torch.bfloat16)
    _backward(model, _batch(2), 1.0)
    reducer.finish_micro_batch()
    assert all(t.dtype == torch.bfloat16 for t in reducer.accumulated.values())
    reducer.finish_step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None and not q.grad.is_sparse:
            assert p.grad.dtype == torch.float64
            torch.testing.assert_close(p.grad, q.grad, rtol=2**-8, atol=1e-30, msg=name)


def test_a_second_backward_into_reduced_buckets_is_refused():
    """Two backward passes in one micro-batch would add to gradients already sent: one clear error."""
    from trainer.backward_reduce import BackwardReducer
    from trainer.parallelize import build_layout

    torch.manual_seed(0)
    model = Transformer(TINY).double()
    _sparse_tables(model)
    BackwardReducer(model, build_layout(0, 1, 1, TINY.n_routed_experts), set(), {}, torch.float64)
    _backward(model, _batch(1), 1.0)
    with pytest.raises(RuntimeError, match="second gradient after its bucket was reduced"):
        _backward(model, _batch(1), 1.0)


def test_grad_accum_dtype_is_checked():
    from conf.errors import ConfigError
    from trainer.backward_reduce import check_grad_accum_dtype

    check_grad_accum_dtype("bf16", 2)
    check_grad_accum_dtype("fp32", 1)
    with pytest.raises(ConfigError, match="expected fp32 or bf16"):
        check_grad_accum_dtype("fp16", 2)
    with pytest.raises(ConfigError, match=r"bf16 needs trainer.zero_stage=2 \(got 1\)"):
        check_grad_accum_dtype("bf16", 1)


def _worker(rank: int, world: int, ep: int, port: int, out_dir: str) -> None:
    from trainer.parallelize import build_layout, optimizer_placement, parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Transformer(TINY).double()
    layout = build_layout(rank, world, ep, TINY.n_routed_experts)
    expert_params = parallelize(model, layout)
    replicas, offsets = optimizer_placement(model, layout, expert_params)
    opt = build_optimizer(model, MuonConfig(), zero_stage=2, rank=rank, world_size=world, replicas=replicas,
                          row_offsets=offsets)
    _sparse_tables(model)
    norm, held = _zero2_step(model, layout, expert_params, opt.owner_ranks(),
                             _batch(world * MICRO)[rank * MICRO:(rank + 1) * MICRO])  # a sequence each
    grads = {name: (None if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad,
                    offsets.get(id(p), 0)) for name, p in model.named_parameters()}
    owned = sum(p.numel() * 8 for p in model.parameters() if opt.owner_ranks()[id(p)] == rank
                and p.grad is not None and not p.grad.is_sparse)
    torch.save({"grads": grads, "norm": norm, "held": held, "owned": owned},
               os.path.join(out_dir, f"grads{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
def test_zero2_at_4_ranks_with_ep2_gives_each_owner_the_whole_batch_gradient(tmp_path, port_base):
    """4 ranks, EP=2, two micro-batches each, float64: every dense and expert gradient reduced during
    the backward lands on its owner alone, equal to one process's gradient of the whole batch (not
    bitwise: the ranks add in another order); each parameter's rows once over all ranks; the global
    norm the same; and after each backward a rank held no more dense gradient than what it owns
    (plus nothing in flight: the buckets are all reduced by then)."""
    reference, norm = _whole_batch_grads(4 * MICRO)
    mp.start_processes(_worker, args=(4, 2, port_base(), str(tmp_path)), nprocs=4, join=True,
                       start_method="spawn")
    held = dict.fromkeys((n for n, _ in reference.named_parameters()), 0)
    for rank in range(4):
        got = torch.load(tmp_path / f"grads{rank}.pt", weights_only=False)
        assert got["norm"] == pytest.approx(norm, rel=1e-12)
        assert 0 < got["held"] <= got["owned"]
        for name, p in reference.named_parameters():
            grad, offset = got["grads"][name]
            if grad is None:
                continue
            held[name] += grad.shape[0]
            want = (p.grad.to_dense() if p.grad.is_sparse else p.grad)[offset:offset + grad.shape[0]]
            torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-14, msg=name)
    for name, p in reference.named_parameters():
        assert held[name] == p.shape[0], name
