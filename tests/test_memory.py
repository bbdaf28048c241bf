"""Memory features give the same numbers: chunked LM loss, activation checkpointing."""
import dataclasses

import torch

from conf.model import TinyModelConfig
from model.transformer import Transformer
from trainer.parallelize import checkpoint_blocks

CFG = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50)


def _loss_and_grads(model, x, y, doc):
    model.zero_grad()
    out = model(x, labels=y, doc_ids=doc)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 65), generator=g)
    y = ids[:, 1:].clone()
    y[0, :5] = -100
    doc = torch.zeros(2, 64, dtype=torch.long)
    doc[1, 30:] = 1
    return ids[:, :-1], y, doc


def test_chunked_loss_equals_full_loss():
    torch.manual_seed(0)
    full = Transformer(CFG)
    chunked = Transformer(dataclasses.replace(CFG, loss_chunk_tokens=24))  # 128 tokens in 6 uneven chunks
    chunked.load_state_dict(full.state_dict())
    a, ga = _loss_and_grads(full, *_batch())
    b, gb = _loss_and_grads(chunked, *_batch())
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-7, msg=name)


def test_activation_checkpointing_keeps_loss_and_gradients():
    torch.manual_seed(0)
    plain = Transformer(CFG)
    ckpt = Transformer(CFG)
    ckpt.load_state_dict(plain.state_dict())
    assert checkpoint_blocks(ckpt) == CFG.n_layers
    a, ga = _loss_and_grads(plain, *_batch())
    b, gb = _loss_and_grads(ckpt, *_batch())
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert ga.keys() == gb.keys()  # every parameter, including compressors read by later layers
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-7, msg=name)
