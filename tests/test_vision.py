"""Vision input (model/vision.py, data/images.py). Expected values are worked out by hand in the
comments from the preprocessing rules of the public image processor and the layouts the module
docstrings state; F.unfold (PyTorch) is the second opinion on the pixel-unshuffle's channel order."""
import dataclasses
import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conf.model import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, ModelConfig, TinyModelConfig
from data.images import (
    collate,
    digit_documents,
    encode_document,
    pack_documents,
    plan_image_grid,
    prepare_image,
    render_digits,
)
from model.runtime import AttentionRuntime
from model.transformer import Transformer
from model.vision import ImageBatch, pixel_unshuffle, vision_rope

TINY = TinyModelConfig(vocab_size=40, vision_n_layers=2)


def test_pixel_unshuffle_moves_3x3_blocks_into_channels_channel_major():
    # a 2 x 4 grid of 2-channel features f(i, j, c) = 1 + 100 i + 10 j + c, padded with zeros to 3 x 6:
    # two tokens, each 2 channels x 9 block positions, channel-major (c * 9 + row * 3 + col)
    x = torch.tensor([[1 + 100 * i + 10 * j + c for c in range(2)] for i in range(2) for j in range(4)],
                     dtype=torch.float32).unsqueeze(0)  # [1, 8, 2]
    out = pixel_unshuffle(x, 2, 4, 3)
    first = [1, 11, 21, 101, 111, 121, 0, 0, 0] + [2, 12, 22, 102, 112, 122, 0, 0, 0]
    second = [31, 0, 0, 131, 0, 0, 0, 0, 0] + [32, 0, 0, 132, 0, 0, 0, 0, 0]
    assert out.tolist() == [[first, second]]
    grid = F.pad(x.view(2, 4, 2).permute(2, 0, 1), (0, 2, 0, 1)).unsqueeze(0)  # [1, C, 3, 6]
    assert torch.equal(out[0], F.unfold(grid, 3, stride=3)[0].T)


def test_vision_rope_rotates_the_first_half_of_the_angles_by_row_and_the_rest_by_column():
    # head_dim 8 -> 4 angles; theta 100: frequencies 100^0 = 1 and 100^(-2/4) = 0.1.
    # Patch 5 of a 2 x 3 grid is row 1, column 2: angles [1, 0.1, 2, 0.2]
    cos, sin = vision_rope(2, 3, 8, 100.0)
    assert cos.shape == (6, 1, 4)
    expected = torch.tensor([1.0, 0.1, 2.0, 0.2])
    torch.testing.assert_close(cos[5, 0], expected.cos())
    torch.testing.assert_close(sin[5, 0], expected.sin())
    torch.testing.assert_close(cos[0, 0], torch.ones(4))


@pytest.mark.parametrize("size, overrides, expected", [
    # 1024 x 701 (w x h) has more than 544^2 pixels: sides round up to 14s, 74 x 51 patches -> 1036 x 714 px;
    # tokens ceil(51/3) = 17 rows of ceil(74/3) = 25, span 17 * 26 + 2 = 444 <= 1024
    ((1024, 701), {}, (17, 25, 714, 1036)),
    # 300 x 200 = 60,000 px < 295,936: scale sqrt(295936 / 60000) = 2.22087 -> int: 666 x 444 px;
    # 48 x 32 patches -> 672 x 448 px, 11 x 16 tokens (span 189)
    ((300, 200), {}, (11, 16, 448, 672)),
    # 1000 x 500 with at most 60 span tokens: 72 x 36 patches would make 12 x 24 tokens (span 302);
    # shrink: w cells = sqrt(58 / 0.5 + 0.25) - 0.5 = 10.28, h cells 5.14; scale = min(10 * 42 / 1000,
    # 5 * 42 / 500) = 0.42 -> 420 x 210 px, 30 x 15 patches, 5 x 10 tokens (span 57)
    ((1000, 500), dict(vision_max_n_token=60, vision_min_pixels=0), (5, 10, 210, 420)),
])
def test_the_resize_plan_matches_hand_computed_sizes(size, overrides, expected):
    assert plan_image_grid(*size, dataclasses.replace(ModelConfig(), **overrides)) == expected


def test_preprocessing_letterboxes_normalises_and_patches_in_raster_order():
    # a 7 x 10 (w x h) image with pixel (x, y) = (10 x, 20 y, 255); patch 7 -> 7 x 14 px (1 x 2 patches),
    # the image centred: rows 0-1 and 12-13 gray 127. Values v / 255 normalised by (v - 0.5) / 0.5
    image = Image.new("RGB", (7, 10))
    image.putdata([(10 * x, 20 * y, 255) for y in range(10) for x in range(7)])
    out = prepare_image(image, TINY)
    assert out.patches.shape == (2, 3, 7, 7) and out.grid == (2, 1)
    assert out.types == [IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END]  # a 1 x 1 token grid

    def norm(v):
        return (v / 255 - 0.5) / 0.5
    torch.testing.assert_close(out.patches[0, :, 0, 0], torch.tensor([norm(127)] * 3))
    torch.testing.assert_close(out.patches[0, :, 2, 3], torch.tensor([norm(30), norm(0), 1.0]))  # (3, 0)
    torch.testing.assert_close(out.patches[1, :, 0, 6], torch.tensor([norm(60), norm(100), 1.0]))  # (6, 5)
    torch.testing.assert_close(out.patches[1, :, 6, 0], torch.tensor([norm(127)] * 3))


def _span(n_h, n_w):
    return [IMAGE_START] + ([IMAGE] * n_w + [IMAGE_NEW_LINE]) * n_h + [IMAGE_END]


def _image_batch():
    """Row 0: one 4 x 6-patch image (2 x 2 tokens) at 3; row 1: the same size at 10, a 2 x 2-patch
    image (1 x 1 token) at 22."""
    torch.manual_seed(0)
    types = torch.full((2, 32), TEXT)
    for row, start, (n_h, n_w) in ((0, 3, (2, 2)), (1, 10, (2, 2)), (1, 22, (1, 1))):
        span = torch.tensor(_span(n_h, n_w))
        types[row, start:start + len(span)] = span
    ids = torch.randint(0, TINY.vocab_size, (2, 32))
    ids[types >= 0] = 0
    labels = torch.where(types >= 0, -100, ids.roll(-1, 1))
    images = ImageBatch([torch.randn(24, 3, 7, 7), torch.randn(24, 3, 7, 7), torch.randn(4, 3, 7, 7)],
                        [(4, 6), (4, 6), (2, 2)], [0, 1, 1], [3, 10, 22])
    return ids, labels, types, images


def test_an_image_text_batch_goes_forward_and_backward():
    ids, labels, types, images = _image_batch()
    model = Transformer(TINY).train()
    out = model(ids, labels=labels, token_types=types, images=images)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    visual = model.visual
    for name, p in visual.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # the 8 + 8 + 4 span tokens are routed (k experts each) apart from the 44 text tokens
    router = model.layers[0].moe.router
    assert router.load_vl.sum() == 20 * TINY.n_activated_experts
    assert router.load.sum() == 44 * TINY.n_activated_experts


def test_the_image_replaces_the_placeholder_embedding():
    ids, labels, types, images = _image_batch()
    model = Transformer(TINY).eval()
    with torch.no_grad():
        logits = model(ids, token_types=types, images=images).logits
        other_ids = torch.where(types >= 0, 7, ids)  # the placeholder id does not matter
        assert torch.equal(model(other_ids, token_types=types, images=images).logits, logits)
        images.patches[2] = images.patches[2] + 1.0  # the pixels do, after the image only
        moved = model(ids, token_types=types, images=images).logits
    assert torch.equal(moved[0], logits[0]) and torch.equal(moved[1, :22], logits[1, :22])
    assert not torch.allclose(moved[1, 22:], logits[1, 22:])


def test_image_tokens_select_experts_with_their_own_bias():
    ids, labels, types, images = _image_batch()
    model = Transformer(TINY).train()
    router = model.layers[0].moe.router
    router.bias_vl[0] = 1e4  # every image-span token picks expert 0; text tokens are not pushed there
    model(ids, labels=labels, token_types=types, images=images)
    n_image = int((types >= 0).sum())
    assert router.load_vl[0] == n_image and router.load_vl.sum() == n_image * TINY.n_activated_experts
    assert router.load[0] < (types < 0).sum()
    router.update_bias(0.5)
    assert router.bias_vl[0] == 1e4 - 0.5 and router.load_vl.sum() == 0


def test_engram_ngrams_start_after_an_image_span():
    # tokens 0-1 text, 2-5 an image span, 6-7 text: n-grams at 2..5 start at t + 1 (all pad), at 6-7
    # they start at 6; a document start at 7 wins there
    types = torch.tensor([[TEXT, TEXT, *_span(1, 1), TEXT, TEXT]])
    rt = AttentionRuntime(1, 8, torch.device("cpu"), doc_ids=torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1]]),
                          token_types=types)
    assert rt.ngram_start.tolist() == [[0, 0, 3, 4, 5, 6, 6, 7]]
    assert rt.image_mask.tolist() == [[False, False, True, True, True, True, False, False]]


def test_a_batch_whose_images_do_not_fill_its_spans_is_refused():
    ids, labels, types, images = _image_batch()
    images = ImageBatch(images.patches[:2], images.grids[:2], images.rows[:2], images.starts[:2])
    with pytest.raises(ValueError, match="9 IMAGE positions but its 2 images make 8 tokens"):
        Transformer(TINY)(ids, labels=labels, token_types=types, images=images)
    with pytest.raises(ValueError, match="no vision tower"):
        Transformer(dataclasses.replace(TINY, vision_n_layers=0))(ids, token_types=types)


def test_rendered_digits_fill_most_of_the_image_height():
    """Each digit gets a 28 x 28 cell and a glyph at least two thirds as tall (the ink's extent), so
    that one aligner token of the tiny tower sees about one digit."""
    for digits in ("7", "47"):
        for seed in range(50):
            image = render_digits(digits, random.Random(seed))
            assert image.size == (28 * len(digits), 28)
            rows, cols = (torch.from_numpy(np.asarray(image)[..., 0].copy()) < 140).nonzero(as_tuple=True)
            assert rows.max() - rows.min() + 1 >= 28 * 2 / 3, (digits, seed)
            assert cols.max() - cols.min() + 1 >= 14 * len(digits), (digits, seed)


def test_rendered_digit_documents_pack_into_rows_the_model_reads():
    class Chars:  # one id per character
        def encode(self, text):
            return [ord(c) % 30 for c in text]
    docs = [encode_document(d, Chars(), TINY, 30, 31, 32) for d in digit_documents(3, seed=0)]
    # 56 x 28 px -> 8 x 4 patches -> 3 x 2 tokens: span 2 * 4 + 2 = 10; " digits: d d" is 12 chars
    assert [len(d.ids) for d in docs] == [1 + 10 + 12 + 1] * 3
    rows = pack_documents(docs, 48, pad_id=33)  # 24 tokens each: two documents fill 48 + 1
    assert [len(r["images"]) for r in rows] == [2, 1]
    batch = collate(rows)
    assert batch["image_rows"] == [0, 0, 1] and batch["image_starts"] == [1, 25, 1]
    assert batch["labels"][0, 10].item() == ord(" ") % 30  # IMAGE_END predicts the caption
    assert (batch["labels"][0, :10] == -100).all() and batch["labels"][0, 23] == -100  # span, next BOS
    assert batch["doc_ids"][0].tolist() == [0] * 24 + [1] * 24
    model = Transformer(TINY)
    images = ImageBatch.from_batch(batch)
    assert "image_patches" not in batch and images.rows == [0, 0, 1]
    out = model(**batch, images=images)
    assert torch.isfinite(out.loss)


class _Chars:
    """One id per character; specials above them."""
    pad_id, bos_id, eos_id = 29, 30, 31

    def encode(self, text):
        return [ord(c) % 29 for c in text]


def test_the_mixed_loader_resumes_at_its_image_and_text_positions():
    from conf.data import DataConfig
    from data.images import ImageTextDataset, load_image_corpus
    from data.loader import DistributedBatchLoader, MixedBatchLoader

    class Text:  # a stand-in text split: sample i is all i
        def __len__(self):
            return 10

        def get_batch(self, indices):
            return {"input_ids": torch.tensor([[i] * 4 for i in indices])}

    train, val = load_image_corpus(DataConfig(image_documents=40, val_fraction=0.1))
    assert (len(train), len(val)) == (40, 4)
    images = ImageTextDataset(train, _Chars(), TINY, seq_len=48)
    assert len(images) == 20  # two 24-token documents a row

    def loader():
        return MixedBatchLoader(DistributedBatchLoader(Text(), 2, 0, 1, seed=1),
                                DistributedBatchLoader(images, 2, 0, 1, seed=1), ratio=1 / 3)
    first = loader()
    served = [first.next_batch() for _ in range(4)]
    # micro-batches 0-3: floor((k + 1) / 3) > floor(k / 3) only for k = 2
    assert ["token_types" in b for b in served] == [False, False, True, False]
    state = first.state_dict()
    expected = [first.next_batch() for _ in range(3)]  # k = 4, 5 (image-text), 6
    resumed = loader()
    resumed.load_state_dict(state)
    for a, b in zip(expected, (resumed.next_batch() for _ in range(3))):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
        if "image_patches" in a:
            assert all(torch.equal(x, y) for x, y in zip(a["image_patches"], b["image_patches"]))
    assert "token_types" in expected[1]


def test_image_text_documents_from_a_jsonl_file_with_image_paths(tmp_path):
    from conf.data import DataConfig
    from data.images import ImageTextDataset, load_image_corpus
    for n in range(4):
        Image.new("RGB", (21, 14), (n * 60, 0, 0)).save(tmp_path / f"im{n}.png")
    lines = [{"text": f"red {n} <image> then <image> end", "images": [f"im{n}.png", f"im{(n + 1) % 4}.png"]}
             for n in range(4)]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    train, val = load_image_corpus(DataConfig(image_source=str(tmp_path / "docs.jsonl"), val_fraction=0.25,
                                              cache_dir=str(tmp_path / "cache")))
    assert (len(train), len(val)) == (3, 1)
    doc = train[0]
    assert [type(s) for s in doc] == [str, dict, str, dict, str] and doc[1]["path"].endswith(".png")
    # 21 x 14 px at patch 7: 3 x 2 patches, one token: span 4; text 6 + 6 + 4 chars; BOS, EOS
    ds = ImageTextDataset(train, _Chars(), TINY, seq_len=40)
    batch = ds.get_batch([0])
    assert batch["token_types"][0].tolist().count(IMAGE) == 2
    assert len(batch["image_patches"]) == 2 and batch["image_grids"] == [(2, 3), (2, 3)]


def test_generate_reads_an_image_prompt_and_decodes_from_its_cache(tmp_path):
    """generate.images: the prompt's image span is prefilled in one forward; the first two sampled
    tokens' log-probs are those of plain forwards over the same image-text sequence."""
    from types import SimpleNamespace

    from inference.generate import generate
    from trainer.generate import _image_prompt

    render_digits("42", random.Random(0)).save(tmp_path / "d.png")
    g = SimpleNamespace(prompt="look <image> digits: ", images=[str(tmp_path / "d.png")])
    model = Transformer(TINY).eval()
    prompt, vision = _image_prompt(g, TINY, _Chars())
    types, images = vision[0]
    assert types.count(IMAGE) == 6 and prompt[0] == _Chars.bos_id and len(prompt) == len(types)
    (out,) = generate(model, [prompt], 2, temperature=0.0, vision=vision, packed=False)
    ids, tt = torch.tensor([prompt + out.tokens[:1]]), torch.tensor([types + [TEXT]])
    with torch.no_grad():
        logp = model(ids, token_types=tt, images=images).logits.log_softmax(-1)
    torch.testing.assert_close(torch.tensor(out.logprobs), logp[0, -2:].gather(-1, torch.tensor(
        [[out.tokens[0]], [out.tokens[1]]]))[:, 0], atol=1e-4, rtol=0)
    with pytest.raises(Exception, match="no vision tower"):
        _image_prompt(g, dataclasses.replace(TINY, vision_n_layers=0), _Chars())
