"""Supervised fine-tuning: the chat rows (loss mask, label shift, effort, packing), chat files
through `datasets`, malformed rows, the built-in set, and `flashtrain sft` end to end."""
import json
import math
import random
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from conf.model import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, TinyModelConfig
from conf.sft import EffortTiers, SFTDataConfig
from data.chat import ChatFormat, Message
from data.errors import DataError
from data.images import prepare_image, render_digits
from data.sft import (
    IGNORE_INDEX,
    Conversation,
    Vision,
    build_sft_datasets,
    builtin_conversations,
    encode_split,
    example,
    load_conversations,
    load_sft_task,
    tier_efforts,
)
from data.tokenizer import TextTokenizer, _train
from model.transformer import Transformer
from model.vision import ImageBatch
from tests.conftest import FAST

WORDS = ("What is the sum of and plus minus times answer check ones tens carry digits number result so "
         "therefore first then add the".split())


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(30))
             + f" {rng.randint(0, 999)} + {rng.randint(0, 999)}"
             for _ in range(300)]
    return TextTokenizer(_train(datasets.Dataset.from_dict({"text": texts}), 400))


# ------------------------------------------------------------------ a stand-in for tasks
@dataclass
class Problem:
    id: str
    prompt: str
    answer: str
    task: str
    meta: dict = field(default_factory=dict)


class AdditionTask:
    """The tasks Task interface on two-digit sums; reasoning grows with the effort."""
    name = "addition"

    def sample(self, rng):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return Problem(f"{a}+{b}", f"What is {a} + {b}?", str(a + b), self.name, {"a": a, "b": b})

    def reasoning(self, problem, effort):
        a, b = problem.meta["a"], problem.meta["b"]
        steps = [f"{a} + {b}"]
        if effort > 50:
            steps.append(f"ones {a % 10} + {b % 10} = {a % 10 + b % 10}")
        if effort >= 100:
            steps += [f"tens {a // 10} + {b // 10} = {a // 10 + b // 10}", f"check {a + b} - {b} = {a}"]
        return "; ".join(steps)

    def answer_text(self, problem):
        return problem.answer

    def verify(self, problem, answer):
        return answer.strip() == problem.answer


def real_task_or_stand_in(monkeypatch):
    try:
        return load_sft_task("arithmetic")
    except DataError:  # tasks not importable here
        module = types.ModuleType("tasks")
        module.load_task = lambda name, **kw: AdditionTask()
        monkeypatch.setitem(sys.modules, "tasks", module)
        return load_sft_task("arithmetic")


# ------------------------------------------------------------------ the chat rows
def test_loss_mask_is_exactly_assistant_content_and_end_of_turn(tok):
    chat = ChatFormat(tok)
    t, enc = tok.token_id, tok.encode
    convo = [Message("user", "What is 12 + 30?"), Message("assistant", "42", "12 + 30 = 42"),
             Message("user", "and 1 + 1?"), Message("assistant", "2")]
    ids, mask = chat.encode(convo, effort=75)
    expected = [  # (token, in the loss?)
        (t("<|bos|>"), False), (t("<|system|>"), False), *[(i, False) for i in enc("Reasoning Effort: 75")],
        (t("<|end_of_turn|>"), False),
        (t("<|user|>"), False), *[(i, False) for i in enc("What is 12 + 30?")], (t("<|end_of_turn|>"), False),
        (t("<|assistant|>"), False), (t("<|think|>"), True), *[(i, True) for i in enc("12 + 30 = 42")],
        (t("<|/think|>"), True), *[(i, True) for i in enc("42")], (t("<|end_of_turn|>"), True),
        (t("<|user|>"), False), *[(i, False) for i in enc("and 1 + 1?")], (t("<|end_of_turn|>"), False),
        (t("<|assistant|>"), False), (t("<|think|>"), True), (t("<|/think|>"), True),
        *[(i, True) for i in enc("2")], (t("<|end_of_turn|>"), True),
    ]
    assert len(ids) == len(expected)
    for pos, ((token, in_loss), got_id, got_mask) in enumerate(zip(expected, ids, mask)):
        assert (got_id, got_mask) == (token, in_loss), (pos, tok.decode([got_id]))
    assert tok.decode(ids).startswith("<|bos|><|system|>Reasoning Effort: 75<|end_of_turn|><|user|>")


def test_labels_are_the_next_token_where_that_token_is_an_assistant_token(tok):
    chat = ChatFormat(tok)
    ids, mask = chat.encode([Message("user", "What is 3 + 4?"), Message("assistant", "7", "3 + 4 = 7")],
                            effort=50)
    inputs, labels = example(ids, mask)
    assert inputs.tolist() == ids[:-1]
    for i in range(len(inputs)):
        assert labels[i] == (ids[i + 1] if mask[i + 1] else IGNORE_INDEX), i
    # the position holding <|assistant|> predicts <|think|>; the one before it predicts nothing
    a = ids.index(tok.token_id("<|assistant|>"))
    assert labels[a] == tok.token_id("<|think|>") and labels[a - 1] == IGNORE_INDEX
    assert labels[-1] == tok.token_id("<|end_of_turn|>")

    row = encode_split([Conversation([Message("user", "What is 3 + 4?"),
                                      Message("assistant", "7", "3 + 4 = 7")],
                                     50, "x")], chat, 64, True, "train")
    batch = row.get_batch([0])
    n = len(ids) - 1
    assert (batch["input_ids"][0, :n].tolist() == ids[:-1]
            and batch["labels"][0, :n].tolist() == labels.tolist())
    assert (batch["input_ids"][0, n:] == tok.pad_id).all() and (batch["labels"][0, n:] == IGNORE_INDEX).all()
    assert row.stats.assistant_tokens == int((labels != IGNORE_INDEX).sum())


def test_system_prompt_carries_each_conversations_effort(tok, monkeypatch):
    task = real_task_or_stand_in(monkeypatch)
    convs = builtin_conversations(task, 60, 0, tier_efforts(EffortTiers(), ["low", "high", "max"]))
    assert {c.effort for c in convs} == {50, 75, 100}
    chat = ChatFormat(tok)
    for c in convs[:10]:
        ids, _ = chat.encode(c.messages, c.effort)
        assert f"<|system|>Reasoning Effort: {c.effort}<|end_of_turn|>" in tok.decode(ids)
    only_max = builtin_conversations(task, 20, 0, tier_efforts(EffortTiers(max=90), ["max"]))
    assert {c.effort for c in only_max} == {90}
    with pytest.raises(DataError, match="unknown tier"):
        tier_efforts(EffortTiers(), ["low", "medium"])


def test_packing_keeps_conversations_apart(tok):
    chat = ChatFormat(tok)
    rng = random.Random(1)
    convs = []
    for i in range(40):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        reasoning = " then ".join(f"{a} plus {b}" for _ in range(rng.randint(0, 6)))
        convs.append(Conversation([Message("user", f"What is {a} + {b}?"),
                                   Message("assistant", str(a + b), reasoning)], rng.choice([50, 75, 100]),
                                  f"c{i}"))
    ds = encode_split(convs, chat, 256, True, "train")
    assert len(ds) < len(convs) / 2, "conversations are packed several to a row"
    encoded = {tuple(chat.encode(c.messages, c.effort)[0][:-1]) for c in convs}
    found, labelled = [], 0
    for r in range(len(ds)):
        row = ds[r]
        ids, labels, docs = row["input_ids"].numpy(), row["labels"].numpy(), row["doc_ids"].numpy()
        assert (np.diff(docs) >= 0).all() and docs[0] == 0
        for d in np.unique(docs):
            seg = ids[docs == d]
            if seg[0] == tok.pad_id:  # the padding at the end of a row: a document of its own, no loss
                assert (seg == tok.pad_id).all() and (labels[docs == d] == IGNORE_INDEX).all()
                continue
            assert seg[0] == tok.bos_id and (seg[1:] != tok.bos_id).all()  # one conversation per document
            found.append(tuple(seg.tolist()))
            last = np.flatnonzero(docs == d)[-1]
            assert labels[last] == tok.token_id("<|end_of_turn|>")  # never the next conversation's BOS
        labelled += int((labels != IGNORE_INDEX).sum())
    assert sorted(found) == sorted(encoded) and len(found) == len(convs)
    assert labelled == ds.stats.assistant_tokens

    single = encode_split(convs, chat, 256, False, "train")
    assert len(single) == len(convs) and set(single.doc_ids.max(axis=1).tolist()) == {1}


def test_long_conversations_are_truncated_and_counted(tok, caplog):
    chat = ChatFormat(tok)
    long = Conversation([Message("user", "What is 1 + 1?"), Message("assistant", "2", "one plus one " * 200)],
                        100, "l")
    short = Conversation([Message("user", "What is 1 + 2?"), Message("assistant", "3")], 50, "s")
    with caplog.at_level("WARNING"):
        ds = encode_split([long, short], chat, 48, True, "train")
    assert ds.stats.truncated == 1 and "truncated" in caplog.text
    assert len(ds) == 2 and (ds.doc_ids[0] == 0).all()  # the cut conversation fills its row
    prompt_only = Conversation([Message("user", "word " * 100), Message("assistant", "x")], 50, "p")
    ds = encode_split([prompt_only, short], chat, 32, True, "train")
    assert ds.stats.dropped == 1 and len(ds) == 1  # nothing of the assistant turn fits: no row


def test_builtin_reasoning_is_longer_at_higher_effort(tok, monkeypatch):
    task = real_task_or_stand_in(monkeypatch)
    convs = builtin_conversations(task, 300, 0, [50, 100])
    length = {e: np.mean([len(tok.encode(c.messages[1].reasoning or "")) for c in convs if c.effort == e])
              for e in (50, 100)}
    assert length[100] > 1.3 * length[50], length
    again = builtin_conversations(task, 300, 0, [50, 100])  # offline and deterministic
    assert [(c.messages[0].content, c.messages[1].reasoning, c.effort) for c in again] == \
        [(c.messages[0].content, c.messages[1].reasoning, c.effort) for c in convs]


# ------------------------------------------------------------------ files through `datasets`
def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat_row(i: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                         {"role": "assistant", "content": str(2 * i), "reasoning": f"{i} + {i} = {2 * i}"}],
            **extra}


def test_jsonl_and_parquet_chat_files_load_through_datasets(tok, tmp_path):
    rows = [_chat_row(1, effort=100), _chat_row(2, effort="low"), _chat_row(3), _chat_row(4, effort=None)]
    rows[3]["messages"].insert(0, {"role": "system", "content": "You are terse."})
    rows[3].pop("effort")
    src = _write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = SFTDataConfig(source=str(src), tiers=["max"], val_fraction=0.25)
    convs = load_conversations(cfg, EffortTiers(), str(tmp_path / "hf"))
    # own, tier name, drawn from tiers, own system turn
    assert [c.effort for c in convs] == [100, 50, 100, None]
    assert convs[0].messages[1] == Message("assistant", "2", "1 + 1 = 2") and convs[0].where == f"{src} row 1"
    train, val = build_sft_datasets(cfg, EffortTiers(), tok, str(tmp_path / "hf"))
    assert train.stats.conversations == 3 and val.stats.conversations == 1

    flat = tmp_path / "flat.parquet"
    datasets.Dataset.from_dict({"q": ["What is 5 + 5?", "What is 6 + 6?"], "a": ["10", "12"],
                                "why": ["5 + 5 = 10", None], "effort": [75, 50]}).to_parquet(str(flat))
    cfg = SFTDataConfig(source=str(tmp_path / "*.parquet"), prompt_field="q", response_field="a",
                        reasoning_field="why")
    convs = load_conversations(cfg, EffortTiers(), str(tmp_path / "hf"))
    assert [(c.messages[0].content, c.messages[1].reasoning, c.effort) for c in convs] == [
        ("What is 5 + 5?", "5 + 5 = 10", 75), ("What is 6 + 6?", None, 50)]


@pytest.mark.parametrize("bad, needle", [
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}, "content is missing"),
    ({"other": 1}, "no 'messages' field"),
    (_chat_row(9, effort=150), "effort 150"),
    (_chat_row(9, effort="medium"), "effort 'medium'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
])
def test_malformed_rows_name_file_and_row(tmp_path, bad, needle):
    src = _write_jsonl(tmp_path / "chat.jsonl", [_chat_row(1, effort=50), bad])
    with pytest.raises(DataError) as err:
        load_conversations(SFTDataConfig(source=str(src)), EffortTiers(), str(tmp_path / "hf"))
    message = str(err.value)
    assert f"{src} row 2" in message and needle in message and "\n" not in message, message


def test_invalid_json_line_is_named_once(tmp_path, caplog):
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps(_chat_row(1)) + "\n{not json\n")
    with pytest.raises(DataError, match=r"chat\.jsonl:2: not valid JSON"):
        load_conversations(SFTDataConfig(source=str(src)), EffortTiers(), str(tmp_path / "hf"))
    # not also datasets' own, with its row count
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    with pytest.raises(DataError, match="does not exist"):
        load_conversations(SFTDataConfig(source=str(tmp_path / "missing.jsonl")), EffortTiers())


# ------------------------------------------------------------------ image messages
VISION = TinyModelConfig(vocab_size=512, vision_n_layers=2)  # patch 7, no minimum size: 56 x 28 px is 8 x 4


def _digits(tmp_path: Path, name: str, text: str, size=(56, 28)) -> Path:
    path = tmp_path / name
    render_digits(text, random.Random(text), height=size[1], width=size[0]).save(path)
    return path


def _image_rows(tmp_path: Path, count: int = 1) -> list[dict]:
    """User: an image (as a content part, its path relative to the file), then a question; the
    assistant reads it."""
    rows = []
    for i in range(count):
        digits = f"{i % 10} {(3 * i + 1) % 10}"
        _digits(tmp_path, f"d{i}.png", digits.replace(" ", ""))
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"d{i}.png"},
                                         {"type": "text", "text": " Which digits?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": digits}]}], "effort": 50})
    return rows


def _vision(tok):
    return Vision(VISION, tok.pad_id)


# a 56 x 28 image: 4 x 8 patches of 7 px, a token grid of ceil(4/3) = 2 rows of ceil(8/3) = 3
SPAN = [IMAGE_START, IMAGE, IMAGE, IMAGE, IMAGE_NEW_LINE, IMAGE, IMAGE, IMAGE, IMAGE_NEW_LINE, IMAGE_END]


def test_an_image_message_becomes_a_span_outside_the_loss(tok, tmp_path):
    src = _write_jsonl(tmp_path / "chat.jsonl", _image_rows(tmp_path))
    (conv,) = load_conversations(SFTDataConfig(source=str(src)), EffortTiers(), str(tmp_path / "hf"))
    assert conv.messages[0].content == [{"path": str(tmp_path / "d0.png")}, " Which digits?"]
    assert conv.messages[1].content == "0 1"
    ds = encode_split([conv], ChatFormat(tok), 64, True, "train", _vision(tok))
    t, enc, pad = tok.token_id, tok.encode, tok.pad_id
    expected = [  # (id, token type, in the loss?)
        (tok.bos_id, TEXT, False), (t("<|system|>"), TEXT, False),
        *[(i, TEXT, False) for i in enc("Reasoning Effort: 50")], (t("<|end_of_turn|>"), TEXT, False),
        (t("<|user|>"), TEXT, False), *[(pad, k, False) for k in SPAN],
        *[(i, TEXT, False) for i in enc(" Which digits?")], (t("<|end_of_turn|>"), TEXT, False),
        (t("<|assistant|>"), TEXT, False), (t("<|think|>"), TEXT, True), (t("<|/think|>"), TEXT, True),
        *[(i, TEXT, True) for i in enc("0 1")], (t("<|end_of_turn|>"), TEXT, True)]
    batch = ds.get_batch([0])
    n = len(expected) - 1
    assert batch["input_ids"][0, :n].tolist() == [i for i, _, _ in expected[:-1]]
    assert batch["token_types"][0, :n].tolist() == [k for _, k, _ in expected[:-1]]
    assert (batch["token_types"][0, n:] == TEXT).all() and (batch["input_ids"][0, n:] == pad).all()
    # position i is trained on token i + 1 exactly when that token is in the loss: never a span
    assert batch["labels"][0, :n].tolist() == [i if trained else IGNORE_INDEX
                                               for i, _, trained in expected[1:]]
    assert (batch["labels"][0, n:] == IGNORE_INDEX).all()
    start = 1 + 1 + len(enc("Reasoning Effort: 50")) + 1 + 1
    assert batch["image_starts"] == [start] and batch["image_rows"] == [0]
    assert batch["image_grids"] == [(4, 8)]
    assert torch.equal(batch["image_patches"][0], prepare_image(str(tmp_path / "d0.png"), VISION).patches)
    assert ds.stats.images == 1 and ds.stats.assistant_tokens == sum(trained for _, _, trained in expected)


def test_an_sft_image_batch_goes_forward_and_backward(tok, tmp_path):
    src = _write_jsonl(tmp_path / "chat.jsonl", _image_rows(tmp_path, 4))
    convs = load_conversations(SFTDataConfig(source=str(src)), EffortTiers(), str(tmp_path / "hf"))
    ds = encode_split(convs, ChatFormat(tok), 64, False, "train", _vision(tok))
    batch = ds.get_batch([0, 3])
    images = ImageBatch.from_batch(batch)
    assert images.rows == [0, 1] and len(images) == 2
    torch.manual_seed(0)
    model = Transformer(VISION).train()
    out = model(**batch, images=images)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for name, p in model.visual.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # every span position routes as an image token
    n_span = int((batch["token_types"] >= 0).sum())
    assert n_span == 2 * len(SPAN)
    assert model.layers[0].moe.router.load_vl.sum() == n_span * VISION.n_activated_experts


def test_an_images_column_fills_the_image_markers_in_order(tok, tmp_path):
    for name in ("a", "b"):
        _digits(tmp_path, f"{name}.png", "12" if name == "a" else "7")
    rows = [{"messages": [{"role": "user", "content": "Is <image> more than <image>?"},
                          {"role": "assistant", "content": "yes"}], "images": ["a.png", "b.png"]},
            {"messages": [{"role": "system", "content": "Read it."}, {"role": "user", "content": "Which?"},
                          {"role": "assistant", "content": "7"}], "images": ["b.png"]},
            {"messages": [{"role": "user", "content": "no image here"},
                          {"role": "assistant", "content": "42"}], "images": []}]
    src = _write_jsonl(tmp_path / "chat.jsonl", rows)
    convs = load_conversations(SFTDataConfig(source=str(src)), EffortTiers(), str(tmp_path / "hf"))
    a, b = {"path": str(tmp_path / "a.png")}, {"path": str(tmp_path / "b.png")}
    assert convs[0].messages[0].content == ["Is ", a, " more than ", b, "?"]
    assert convs[1].messages[1].content == [b, "Which?"]  # no marker: before the first user turn's text
    assert convs[2].messages[0].content == "no image here" and convs[2].images == []
    # contents as strings and as parts in one file: read as written, "42" stays a string
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", [*_image_rows(tmp_path), rows[2]])
    convs_mixed = load_conversations(SFTDataConfig(source=str(mixed)), EffortTiers(), str(tmp_path / "hf"))
    assert convs_mixed[1].messages[1].content == "42" and convs_mixed[0].messages[1].content == "0 1"
    ds = encode_split(convs, ChatFormat(tok), 96, False, "train", _vision(tok))
    batch = ds.get_batch([0, 1, 2])
    assert batch["image_rows"] == [0, 0, 1] and (batch["token_types"][2] == TEXT).all()
    user = batch["input_ids"][0].tolist().index(tok.token_id("<|user|>"))
    first = user + 1 + len(tok.encode("Is "))
    assert batch["image_starts"][:2] == [first, first + len(SPAN) + len(tok.encode(" more than "))]


def test_a_conversation_is_cut_before_an_image_span_that_would_not_fit(tok, tmp_path):
    image = {"path": str(_digits(tmp_path, "d.png", "5"))}
    conv = Conversation([Message("user", "What is 1 + 1?"), Message("assistant", "2"),
                         Message("user", ["Then this: ", image]), Message("assistant", "5")], 50, "c")
    chat = ChatFormat(tok)
    first = len(chat.encode(conv.messages[:2], 50)[0])  # the first exchange
    start = first + 1 + len(tok.encode("Then this: "))  # the span's first position
    for seq_len in (start + 2, start + len(SPAN) - 1):  # cut inside the span, or right after its end
        ds = encode_split([conv], chat, seq_len, True, "train", _vision(tok))
        assert ds.stats.truncated == 1 and ds.images == [[]], seq_len
        assert (ds.labels[0] != IGNORE_INDEX).sum() > 0 and (ds.input_ids[0, start - 1:] == tok.pad_id).all()
    ds = encode_split([conv], chat, start + len(SPAN) + 1, True, "train", _vision(tok))
    assert [slot.start for slot in ds.images[0]] == [start]  # whole within the inputs: kept


def test_the_sft_loader_resumes_at_the_same_image_batch(tok, tmp_path):
    from data.loader import DistributedBatchLoader

    src = _write_jsonl(tmp_path / "chat.jsonl", _image_rows(tmp_path, 10))
    convs = load_conversations(SFTDataConfig(source=str(src)), EffortTiers(), str(tmp_path / "hf"))
    ds = encode_split(convs, ChatFormat(tok), 64, False, "train", _vision(tok))
    first = DistributedBatchLoader(ds, 2, 0, 1, seed=3)
    for _ in range(6):  # into the second epoch (5 batches each)
        first.next_batch()
    resumed = DistributedBatchLoader(ds, 2, 0, 1, seed=3)
    resumed.load_state_dict(first.state_dict())
    a, b = first.next_batch(), resumed.next_batch()
    for key in ("input_ids", "labels", "token_types"):
        assert torch.equal(a[key], b[key]), key
    assert a["image_starts"] == b["image_starts"] and len(a["image_patches"]) == 2
    assert all(torch.equal(x, y) for x, y in zip(a["image_patches"], b["image_patches"]))


@pytest.mark.parametrize("bad, needle", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "missing.png"}]},
                   {"role": "assistant", "content": "1"}]}, "message 0 part 0: image file"),
    ({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
                   {"role": "assistant", "content": "1"}]}, "message 0 part 0 has type 'audio'"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]},
                   {"role": "assistant", "content": "1"}]}, "message 0 part 0: the image is missing"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "image", "image": "d0.png"}]}]},
     "an image in an assistant turn"),
    ({"messages": [{"role": "user", "content": "<image> hi"}, {"role": "assistant", "content": "1"}],
      "images": ["d0.png", "d0.png"]}, "1 <image> markers in its messages but 2 images"),
    ({"messages": [{"role": "user", "content": "hi"}], "images": ["missing.png"]}, "image 0: image file"),
])
def test_malformed_image_rows_name_file_and_row(tmp_path, bad, needle):
    rows = _image_rows(tmp_path)
    src = _write_jsonl(tmp_path / "chat.jsonl", [rows[0], bad])
    with pytest.raises(DataError) as err:
        load_conversations(SFTDataConfig(source=str(src)), EffortTiers(), str(tmp_path / "hf"))
    message = str(err.value)
    assert f"{src} row 2" in message and needle in message and "\n" not in message, message


def test_unreadable_images_and_a_model_without_a_tower_name_the_row(tok, tmp_path):
    rows = _image_rows(tmp_path, 2)
    (tmp_path / "d1.png").write_text("not an image")
    src = _write_jsonl(tmp_path / "chat.jsonl", rows)
    convs = load_conversations(SFTDataConfig(source=str(src)), EffortTiers(), str(tmp_path / "hf"))
    with pytest.raises(DataError, match=rf"{src} row 2: cannot read image .*d1\.png"):
        encode_split(convs, ChatFormat(tok), 64, True, "train", _vision(tok))
    with pytest.raises(DataError, match=rf"{src} row 1: has images, but the model has no vision tower"):
        encode_split(convs, ChatFormat(tok), 64, True, "train")


# ------------------------------------------------------------------ the CLI
def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_malformed_file_exits_2_with_one_line(flashtrain, corpus, tmp_path):
    src = _write_jsonl(tmp_path / "chat.jsonl",
                       [_chat_row(1), {"messages": [{"role": "robot", "content": "x"}]}])
    p = flashtrain("sft", *FAST, *corpus, f"sft.source={src}", f"hydra.run.dir={tmp_path / 'run'}")
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert len(lines) == 1 and f"{src} row 2" in lines[0] and "robot" in lines[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr


def test_image_rows_exit_2_with_one_line(flashtrain, corpus, tmp_path):
    rows = _image_rows(tmp_path, 2)
    src = _write_jsonl(tmp_path / "chat.jsonl", rows)
    # a model without a vision tower: the first image conversation of the train split is named
    p = flashtrain("sft", *FAST, *corpus, f"sft.source={src}", "sft.val_fraction=0.5", "eval.problems=0",
                   f"hydra.run.dir={tmp_path / 'run'}")
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    no_tower = "has images, but the model has no vision tower"
    assert re.search(rf"{re.escape(str(src))} row [12]: {no_tower}", lines[0]), lines[0]
    rows[1]["messages"][0]["content"][0]["image"] = "gone.png"
    src = _write_jsonl(tmp_path / "chat.jsonl", rows)
    p = flashtrain("sft", *FAST, *corpus, "model.vision_n_layers=2", f"sft.source={src}",
                   f"hydra.run.dir={tmp_path / 'run2'}")
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert f"{src} row 2: message 0 part 0: image file {tmp_path / 'gone.png'} does not exist" in lines[0]


@pytest.mark.parametrize("fraction, split, hint", [("0.8", "train", "a smaller sft.val_fraction"),
                                                   ("0.2", "validation", "a larger sft.val_fraction")])
def test_a_split_too_small_says_which_way_to_move_the_fraction(flashtrain, corpus, tmp_path, fraction, split,
                                                               hint):
    src = _write_jsonl(tmp_path / "chat.jsonl", [_chat_row(i) for i in range(5)])
    p = flashtrain("sft", *FAST, *corpus, f"sft.source={src}", f"sft.val_fraction={fraction}",
                   "sft.pack=false", "trainer.micro_batch_size=2", f"hydra.run.dir={tmp_path / 'run'}")
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert f"the SFT {split} split has 1 rows" in lines[0] and hint in lines[0], lines[0]


@pytest.mark.parametrize("bad, needle",
                         [("model.init_from=/nonexistent/run", "model.init_from=/nonexistent/run: no such"),
                          ("sft.tiers=[low,medium]", "unknown tier(s) ['medium']")])
def test_bad_settings_exit_2_before_any_work(flashtrain, tmp_path, bad, needle):
    p = flashtrain("sft", *FAST, bad, f"hydra.run.dir={tmp_path / 'run'}")
    assert p.returncode == 2 and needle in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
def test_sft_on_image_messages_end_to_end_then_resume(flashtrain, corpus, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    src = _write_jsonl(data / "chat.jsonl", _image_rows(data, 24))
    run = tmp_path / "sft"
    common = [*FAST, *corpus, "trainer.torch_threads=1", "model.vision_n_layers=2", f"sft.source={src}",
              "sft.seq_len=64", "sft.val_fraction=0.2", "eval.problems=0", "trainer.save_every=2",
              "trainer.eval_every=2", f"hydra.run.dir={run}"]
    p = flashtrain("sft", *common, "trainer.max_steps=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "19 / 5 images" in p.stdout, p.stdout[-3000:]
    rows = _rows(run)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and any("val_loss" in r for r in rows)
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    p = flashtrain("sft", *common, "trainer.max_steps=3")  # the same run dir: continues from step 2
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming from" in p.stdout and "step_00000002" in p.stdout, p.stdout[-3000:]
    assert [r["step"] for r in _rows(run) if "loss" in r] == [1, 2, 3]


@pytest.mark.slow
def test_sft_end_to_end_from_a_pretraining_checkpoint_then_resume(flashtrain, corpus, tmp_path):
    common = [*FAST, *corpus, "trainer.torch_threads=1"]
    pre = tmp_path / "pre"
    p = flashtrain("pretrain", *common, "trainer.max_steps=2", f"hydra.run.dir={pre}")
    assert p.returncode == 0, p.stderr[-3000:]

    run = tmp_path / "sft"
    sft = [*common, f"model.init_from={pre / 'checkpoints'}", "sft.builtin_samples=200", "sft.seq_len=128",
           "trainer.save_every=3", "eval.problems=3", "eval.max_new_tokens=12", f"hydra.run.dir={run}"]
    p = flashtrain("sft", *sft, "trainer.max_steps=3")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "flashtrain sft: eval" in p.stdout and "effort 100: accuracy" in p.stdout, p.stdout[-3000:]
    rows = _rows(run)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert any("val_loss" in r for r in rows)
    evals = [r for r in rows if "eval/effort_50/accuracy" in r]
    assert len(evals) == 1 and evals[0]["step"] == 3
    for e in (50, 75, 100):
        assert 0 <= evals[0][f"eval/effort_{e}/accuracy"] <= 1
        assert 0 < evals[0][f"eval/effort_{e}/mean_len"] <= 12
    assert (run / "config.yaml").read_text().startswith("stage: sft")

    p = flashtrain("sft", *sft, "trainer.max_steps=5")  # the same run dir: continues from step 3
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming from" in p.stdout and "step_00000003" in p.stdout, p.stdout[-3000:]
    rows = _rows(run)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "eval/effort_100/mean_len" in r] == [3, 5]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000005"
