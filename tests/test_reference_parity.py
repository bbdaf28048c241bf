"""bench/system/reference_parity.py without the public code: the image prompt's layout, and the whole
script run against a stand-in for the public code's interface that wraps flashtrain itself, so that
every comparison the script makes between two equal models reads zero (its plumbing hands both sides
the same ids, spans, patches and positions). The comparison with the public code itself needs it on
disk (`--reference REF`; bench/reports/2026-12-06-reference-parity.md)."""
import dataclasses
import json
import random
import sys
import textwrap

import datasets
import pytest
import torch

from bench.system.reference_parity import IMAGE_AFTER, digits_png, flashtrain_config, image_case
from conf.model import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, TinyModelConfig

VISION = dataclasses.replace(TinyModelConfig(vocab_size=512), vision_n_layers=2)


def test_the_image_prompt_puts_the_span_between_the_rows_text():
    text = list(range(100, 228))
    case = image_case(digits_png(), VISION, text, 128, image_token_id=7)
    # 112 x 56 px in patches of 7: 8 x 16, a token grid of ceil(8/3) = 3 rows of ceil(16/3) = 6 tokens
    span = [IMAGE_START, *([IMAGE] * 6 + [IMAGE_NEW_LINE]) * 3, IMAGE_END]
    assert case.image.grid == (8, 16) and case.image.types == span and case.patches.shape == (128, 3, 7, 7)
    assert case.ids.shape == case.types.shape == (2, 128) and case.starts == list(IMAGE_AFTER)
    for row, start in enumerate(IMAGE_AFTER):
        ids, types = case.ids[row].tolist(), case.types[row].tolist()
        assert types == [TEXT] * start + span + [TEXT] * (128 - start - len(span))
        assert ids[start:start + len(span)] == [7] * len(span)
        assert ids[:start] + ids[start + len(span):] == text[:128 - len(span)]  # the text runs on past it
    images = case.flashtrain_images()
    assert images.rows == [0, 1] and images.starts == list(IMAGE_AFTER) and images.grids == [(8, 16)] * 2
    with pytest.raises(SystemExit, match="--tokens 40: too few"):
        image_case(digits_png(), VISION, text, 40, image_token_id=7)


def test_the_flashtrain_side_takes_the_vision_tower_from_config_json():
    config = {"vocab_size": 600, "vision_n_layers": 3, "vision_dim": 32, "vision_max_wh_ratio": None,
              "image_token_id": 5, "dim": 64}
    cfg = flashtrain_config(config, "tiny", qat=True)
    assert (cfg.vocab_size, cfg.vision_n_layers, cfg.vision_dim, cfg.kv_quant) == (600, 3, 32, "qat")
    assert flashtrain_config({"vocab_size": 600}, "tiny", qat=False).vision_n_layers == 0


STAND_IN_MODEL = '''
    """The public inference code's interface (what bench/system/reference_parity.py calls), wrapping
    flashtrain's own model: a plumbing check, not the public code."""
    import os
    from pathlib import Path

    import torch.nn.functional as F
    from torch import nn

    from .kernel_cpu import act_quant, fp4_act_quant  # noqa: F401  (the script swaps these)
    from .vision import Aligner, ViT  # noqa: F401


    class ModelArgs:
        def __init__(self, **config):
            self.__dict__.update(config)


    class ParallelEngramEmbedding(nn.Module):
        pass


    def linear(x, weight, bias=None):
        return F.linear(x, weight)


    class Head(nn.Module):
        def forward(self, x, full_logits=False):
            return x


    class Transformer(nn.Module):
        def __init__(self, args, tokenizer=None):
            super().__init__()
            self.args, self.head, self.prefix = args, Head(), None

        def load_state_dict(self, state, strict=True):
            self.export = Path(os.environ["STAND_IN_EXPORT"])

        def forward(self, ids, start_pos=0, images=None, token_types=None):
            import torch

            from bench.system.reference_parity import build_flashtrain
            from model.vision import ImageBatch

            # the script turns the cache quantisers off by swapping act_quant
            qat = globals()["act_quant"].__name__ == "act_quant"
            model = build_flashtrain(self.export, "tiny", self.export / "tokenizer.json", qat)
            if start_pos == 0:
                self.prefix = (ids, token_types, images)
                full, types = ids, token_types
            else:  # decoding: the prefill's tokens, then these
                full = torch.cat([self.prefix[0], ids], 1)
                types = None if self.prefix[1] is None else torch.cat([self.prefix[1], 0 * ids - 1], 1)
            batch = None
            if self.prefix[2] is not None:
                records = [(r, im) for r, row in enumerate(self.prefix[2]) for im in row]
                batch = ImageBatch([im.patches.float() for _, im in records],
                                   [(im.n_vit_h, im.n_vit_w) for _, im in records],
                                   [r for r, _ in records], [im.start for _, im in records])
            logits = model(full, token_types=types, images=batch).logits.float()
            return None, self.head(logits[:, -ids.shape[1]:]), None
'''

STAND_IN_IMAGE_PROCESSOR = '''
    import dataclasses

    import torch

    IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)


    @dataclasses.dataclass
    class ImageInput:
        start: int
        patches: torch.Tensor
        n_vit_h: int
        n_vit_w: int
        types: torch.Tensor


    def load_image(record, args):
        from conf.model import TinyModelConfig
        from data.images import prepare_image

        vision = {k: v for k, v in vars(args).items() if k.startswith("vision_")}
        image = prepare_image(record["data"], dataclasses.replace(TinyModelConfig(), **vision))
        n_h = image.types.count(IMAGE_NEW_LINE)
        return image.patches.bfloat16(), *image.grid, n_h, image.types.count(IMAGE) // n_h


    def image_token_types(n_llm_h, n_llm_w):
        return torch.tensor([IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END])
'''


@pytest.mark.slow
def test_the_script_hands_both_sides_the_same_image_prompt(tmp_path, monkeypatch):
    from bench.system.reference_parity import main
    from data.tokenizer import TextTokenizer, _train
    from model.engram import build_compression_map
    from model.transformer import Transformer
    from trainer.interop.convert import export_model

    rng = random.Random(0)
    words = "def class import return self value for in if else while".split()
    texts = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(200)]
    tok = TextTokenizer(_train(datasets.Dataset.from_dict({"text": texts}), 400))
    cfg = dataclasses.replace(TinyModelConfig(), vocab_size=tok.vocab_size, vision_n_layers=2)
    lookup, _ = build_compression_map(tok.tokenizer, cfg.vocab_size)
    torch.manual_seed(0)
    export = tmp_path / "export"
    export_model(Transformer(cfg, lookup_map=lookup, lookup_pad_id=int(lookup[tok.pad_id])), export,
                 tokenizer=tok, log=lambda _: None)
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "model.py").write_text(textwrap.dedent(STAND_IN_MODEL))
    (ref / "image_processor.py").write_text(textwrap.dedent(STAND_IN_IMAGE_PROCESSOR))
    (ref / "engram.py").write_text("")
    (ref / "vision.py").write_text("ViT = Aligner = None\n")
    monkeypatch.setenv("STAND_IN_EXPORT", str(export))
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts its package on it
    try:
        main(["--reference", str(ref), "--export", str(export), "--tokens", "128",
              "--out", str(tmp_path / "o.json")])
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "public_reference"]:
            del sys.modules[name]
    out = json.loads((tmp_path / "o.json").read_text())
    pre = out["image_preprocessing"]
    assert pre["patch_grid"] == pre["flashtrain_patch_grid"] == [8, 16] and pre["types_equal"]
    assert pre["span"] == 23 and pre["public_patch_dtype"] == "bfloat16"
    assert pre["patches_max_abs_diff_bf16"] == 0
    for key in ("aligned_kv_quant", "aligned_no_quant", "image_aligned_kv_quant", "image_aligned_no_quant",
                "image_decode_last_token"):
        assert out[key] == {"rel_err": 0.0, "top1_agree": 1.0}, key
    # flashtrain on its own fp32 patches reads slightly different pixels than the bf16 ones
    assert 0 < out["image_own_preprocessing"]["rel_err"] < 0.05
