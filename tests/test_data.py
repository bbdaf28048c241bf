"""Tests of the data package: corpus reading, tokenizer, packing, distributed loading, input errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from conf.data import DataConfig
from data import (
    SPECIAL_TOKENS,
    DataError,
    DistributedBatchLoader,
    PackedDataset,
    build_datasets,
    load_documents,
    load_or_train_tokenizer,
)
from data.packing import split_documents

REPO_ROOT = Path(__file__).resolve().parents[1]
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
BOS, EOS, PAD = 0, 1, 2
IGNORE = -100


def _go_offline(monkeypatch: pytest.MonkeyPatch, hf_cache: Path) -> None:
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)
    # `datasets` reads the environment once at import, so its module-level settings are patched too;
    # the hub cache is redirected so that no test writes to the user's home.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_cache)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _go_offline(monkeypatch, tmp_path / "hf-home")


def config(tmp_path: Path, **overrides: object) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path / "cache"), **overrides)


def write_char_tokenizer(path: Path) -> Path:
    """A tokenizer whose ids are known by hand: the special tokens are 0..9 and a, b, c, d are 10..13."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)} | {"a": 10, "b": 11, "c": 12, "d": 13}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path))
    return path


def abcd_corpus(tmp_path: Path, seq_len: int) -> DataConfig:
    """Three one-line documents "abcd" read with `write_char_tokenizer`: 6 tokens each once framed."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("x.txt", "y.txt", "z.txt"):
        (corpus / name).write_text("abcd")
    tokenizer_path = write_char_tokenizer(tmp_path / "chars.json")
    return config(
        tmp_path, name="files", path=str(corpus), tokenizer_path=str(tokenizer_path), seq_len=seq_len
    )


def packed_from_rows(rows: list[list[int]]) -> PackedDataset:
    samples = datasets.Dataset.from_dict({"tokens": pa.array(rows, pa.list_(pa.int32(), len(rows[0])))})
    return PackedDataset(samples, bos_id=BOS, pad_id=PAD)


@pytest.fixture(scope="module")
def stdlib_build(tmp_path_factory: pytest.TempPathFactory):
    """A small real build shared by several tests: 40 standard-library files, 512 tokens, seq_len 64."""
    root = tmp_path_factory.mktemp("stdlib")
    with pytest.MonkeyPatch.context() as monkeypatch:
        _go_offline(monkeypatch, root / "hf-home")
        cfg = config(root, max_documents=40, vocab_size=512, seq_len=64, val_fraction=0.1)
        train, val, tokenizer = build_datasets(cfg)
        yield cfg, train, val, tokenizer


# --- corpus -----------------------------------------------------------------------------------------


def test_stdlib_corpus_is_sorted_and_capped(tmp_path: Path) -> None:
    documents = load_documents(config(tmp_path, max_documents=3))
    first = (Path(sysconfig.get_paths()["stdlib"]) / "__future__.py").read_text(encoding="utf-8")
    assert documents.column_names == ["text"]
    assert len(documents) == 3
    assert documents[0]["text"] == first


def test_files_corpus_reads_every_format_in_path_order(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("alpha\n")
    (corpus / "sub" / "b.md").write_text("# beta")
    (corpus / "c.jsonl").write_text('{"text": "gamma"}\n{"text": ""}\n\n{"text": "delta", "id": 3}\n')
    (corpus / "d.json").write_text(json.dumps([{"text": "epsilon"}, {"text": None}]))
    pq.write_table(pa.table({"text": ["zeta", "eta"]}), corpus / "e.parquet")
    (corpus / "ignored.csv").write_text("text\nnot read\n")
    (corpus / ".hidden.txt").write_text("not read")
    (corpus / "empty.txt").write_text("  \n")

    texts = load_documents(config(tmp_path, name="files", path=str(corpus)))["text"]
    assert list(texts) == ["alpha\n", "gamma", "delta", "epsilon", "zeta", "eta", "# beta"]

    globbed = load_documents(config(tmp_path, name="files", path=str(corpus / "*.jsonl")))["text"]
    assert list(globbed) == ["gamma", "delta"]
    single = load_documents(config(tmp_path, name="files", path=str(corpus / "e.parquet"), max_documents=1))
    assert list(single["text"]) == ["zeta"]


def test_hub_corpus_takes_the_text_field(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "train.jsonl").write_text('{"content": "one"}\n{"content": ""}\n{"content": "two"}\n')
    documents = load_documents(config(tmp_path, name="hub", path=str(hub), text_field="content"))
    assert documents.column_names == ["text"]
    assert list(documents["text"]) == ["one", "two"]

    with pytest.raises(DataError, match=r"no column 'text'"):
        load_documents(config(tmp_path, name="hub", path=str(hub)))


# --- tokenizer --------------------------------------------------------------------------------------


def test_tokenizer_training_is_deterministic_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    documents = load_documents(config(tmp_path, max_documents=30))
    first = load_or_train_tokenizer(config(tmp_path / "one", vocab_size=400), documents)
    second = load_or_train_tokenizer(config(tmp_path / "two", vocab_size=400), documents)
    assert first.path != second.path
    assert first.path.read_bytes() == second.path.read_bytes()

    assert [first.token_id(token) for token in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (first.bos_id, first.eos_id, first.pad_id) == (BOS, EOS, PAD)
    assert first.id_to_token(first.eos_id) == "<|eos|>"
    assert first.vocab_size == 400

    # A second request with the same corpus and settings must load, not train.
    monkeypatch.setattr("data.tokenizer._train", lambda *args: pytest.fail("tokenizer retrained"))
    cached = load_or_train_tokenizer(config(tmp_path / "one", vocab_size=400), documents)
    assert cached.path == first.path


def test_tokenizer_round_trips_and_never_emits_special_tokens_from_text(stdlib_build) -> None:
    *_, tokenizer = stdlib_build
    text = "def f(x):\n    return 'héllo ✓' <|bos|> <|user|>\n"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert min(ids) >= len(SPECIAL_TOKENS)
    assert tokenizer.encode_batch([text, "x"]) == [ids, tokenizer.encode("x")]


def test_loaded_tokenizer_must_fit_the_vocabulary(tmp_path: Path) -> None:
    documents = load_documents(config(tmp_path, max_documents=5))
    path = write_char_tokenizer(tmp_path / "chars.json")
    assert load_or_train_tokenizer(config(tmp_path, tokenizer_path=str(path)), documents).vocab_size == 14
    with pytest.raises(DataError, match="more than data.vocab_size=12"):
        load_or_train_tokenizer(config(tmp_path, tokenizer_path=str(path), vocab_size=12), documents)


# --- packing ----------------------------------------------------------------------------------------


def test_packed_labels_and_doc_ids_by_hand() -> None:
    packed = packed_from_rows(
        [
            [BOS, 10, 11, EOS, BOS, 12, EOS],  # starts on a BOS, a second document begins inside
            [11, EOS, BOS, 13, EOS, BOS, 14],  # starts mid-document, two boundaries
            [12, EOS, PAD, PAD, BOS, 10, EOS],  # padding is never a target
        ]
    )
    batch = packed.get_batch([0, 1, 2])
    assert packed.seq_len == 6
    assert batch["input_ids"].tolist() == [
        [BOS, 10, 11, EOS, BOS, 12],
        [11, EOS, BOS, 13, EOS, BOS],
        [12, EOS, PAD, PAD, BOS, 10],
    ]
    assert batch["labels"].tolist() == [
        [10, 11, EOS, IGNORE, 12, EOS],
        [EOS, IGNORE, 13, EOS, IGNORE, 14],
        [EOS, IGNORE, IGNORE, IGNORE, 10, EOS],
    ]
    assert batch["doc_ids"].tolist() == [
        [0, 0, 0, 0, 1, 1],
        [0, 0, 1, 1, 1, 2],
        [0, 0, 0, 0, 1, 1],
    ]
    assert (batch["input_ids"].dtype, batch["labels"].dtype, batch["doc_ids"].dtype) == (
        torch.int64,
        torch.int64,
        torch.int32,
    )
    item = packed[1]
    assert all(torch.equal(item[name], batch[name][1]) for name in batch)


def test_build_packs_documents_by_hand(tmp_path: Path) -> None:
    train, val, _ = build_datasets(abcd_corpus(tmp_path, seq_len=4))

    # One document is held out. Train stream: B a b c d E B a b c d E, cut as [0:5] and [4:9];
    # the tail [8:12] is shorter than seq_len + 1 and dropped.
    a, b, c, d = 10, 11, 12, 13
    assert len(train) == 2
    assert train[0]["input_ids"].tolist() == [BOS, a, b, c]
    assert train[0]["labels"].tolist() == [a, b, c, d]
    assert train[0]["doc_ids"].tolist() == [0, 0, 0, 0]
    assert train[1]["input_ids"].tolist() == [d, EOS, BOS, a]
    assert train[1]["labels"].tolist() == [EOS, IGNORE, a, b]
    assert train[1]["doc_ids"].tolist() == [0, 0, 1, 1]
    assert len(val) == 1
    assert val[0]["input_ids"].tolist() == [BOS, a, b, c]


def test_packing_follows_the_documents_and_never_crosses_them(stdlib_build) -> None:
    cfg, train, val, tokenizer = stdlib_build
    assert (train.seq_len, len(train) > 50, len(val) > 0) == (64, True, True)
    batch = train.get_batch(range(len(train)))
    inputs, labels, doc_ids = batch["input_ids"], batch["labels"], batch["doc_ids"]

    predicted = labels != IGNORE
    assert not (labels == tokenizer.bos_id).any()
    # A predicted label is the next input token and belongs to the same document.
    assert torch.equal(labels[:, :-1][predicted[:, :-1]], inputs[:, 1:][predicted[:, :-1]])
    assert (doc_ids[:, 1:][predicted[:, :-1]] == doc_ids[:, :-1][predicted[:, :-1]]).all()
    # Exactly the labels that open a document are ignored (the stream has no padding).
    assert (~predicted).sum() == (inputs[:, 1:] == tokenizer.bos_id).sum() + (~predicted[:, -1]).sum()

    # The samples tile the train documents, in order, each framed by BOS and EOS.
    train_docs, _ = split_documents(load_documents(cfg), cfg)
    expected = [t for ids in tokenizer.encode_batch(list(train_docs["text"])) for t in (BOS, *ids, EOS)]
    stream = inputs.reshape(-1).tolist() + [int(train.samples[len(train) - 1]["tokens"][-1])]
    assert stream == expected[: len(stream)]
    assert len(expected) - len(stream) < train.seq_len


def test_build_is_cached(stdlib_build, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, train, val, tokenizer = stdlib_build
    monkeypatch.setattr("data.tokenizer._train", lambda *args: pytest.fail("tokenizer retrained"))
    monkeypatch.setattr("data.packing._pack", lambda *args: pytest.fail("samples repacked"))
    train_again, val_again, tokenizer_again = build_datasets(cfg)
    assert tokenizer_again.path == tokenizer.path
    assert (len(train_again), len(val_again)) == (len(train), len(val))
    assert torch.equal(train_again[7]["input_ids"], train[7]["input_ids"])


def test_concurrent_builds_train_and_pack_once(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import logging
        from conf.data import DataConfig
        from data import build_datasets
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        cfg = DataConfig(cache_dir={str(tmp_path / "cache")!r}, max_documents=20, vocab_size=300, seq_len=32)
        train, val, tokenizer = build_datasets(cfg)
        print("RESULT", len(train), len(val), tokenizer.fingerprint)
        """
    )
    env = os.environ | OFFLINE_ENV | {"HF_DATASETS_CACHE": str(tmp_path / "hf-home")}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=REPO_ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    results = [line for output in outputs for line in output.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2 and results[0] == results[1]
    log = "".join(outputs)
    assert log.count("training a 300-token BPE tokenizer") == 1
    assert log.count("packed the train split") == 1


# --- loader -----------------------------------------------------------------------------------------


@pytest.fixture
def numbered() -> PackedDataset:
    """Ten samples whose first input token is 100 + their index, so batches show which samples they hold."""
    return packed_from_rows([[100 + i, 10, 11, 12, 13] for i in range(10)])


def sample_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return (batch["input_ids"][:, 0] - 100).tolist()


def test_loader_is_deterministic_and_rolls_over_epochs(numbered: PackedDataset) -> None:
    loader = DistributedBatchLoader(numbered, micro_batch_size=4, rank=0, world_size=1, seed=3)
    again = DistributedBatchLoader(numbered, micro_batch_size=4, rank=0, world_size=1, seed=3)
    epochs = [[sample_ids(loader.next_batch()) for _ in range(2)] for _ in range(3)]
    assert epochs == [[sample_ids(again.next_batch()) for _ in range(2)] for _ in range(3)]
    # Two full batches per epoch of 10 samples, 8 distinct samples each, a new order every epoch.
    assert all(len(set(epoch[0] + epoch[1])) == 8 for epoch in epochs)
    assert epochs[0] != epochs[1]
    assert loader.state_dict()["epoch"] == 2

    ordered = DistributedBatchLoader(
        numbered, micro_batch_size=4, rank=0, world_size=1, seed=3, shuffle=False
    )
    batches = iter(ordered)
    assert [sample_ids(next(batches)) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


def test_ranks_split_the_global_batch(numbered: PackedDataset) -> None:
    single = DistributedBatchLoader(numbered, micro_batch_size=4, rank=0, world_size=1, seed=5)
    ranks = [
        DistributedBatchLoader(numbered, micro_batch_size=2, rank=r, world_size=2, seed=5) for r in range(2)
    ]
    for _ in range(5):
        first, second = (sample_ids(loader.next_batch()) for loader in ranks)
        assert not set(first) & set(second)
        assert first + second == sample_ids(single.next_batch())


def test_resume_continues_bitwise(numbered: PackedDataset) -> None:
    loader = DistributedBatchLoader(numbered, micro_batch_size=2, rank=1, world_size=2, seed=7)
    for _ in range(3):
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(4)]  # crosses into the next epoch

    resumed = DistributedBatchLoader(numbered, micro_batch_size=2, rank=1, world_size=2, seed=7)
    resumed.load_state_dict(state)
    for want, got in zip(expected, (resumed.next_batch() for _ in range(4)), strict=True):
        assert all(torch.equal(want[name], got[name]) for name in ("input_ids", "labels", "doc_ids"))


def test_resume_with_another_world_size_keeps_the_sample_order(numbered: PackedDataset) -> None:
    ranks = [
        DistributedBatchLoader(numbered, micro_batch_size=1, rank=r, world_size=2, seed=9) for r in range(2)
    ]
    for _ in range(3):
        for loader in ranks:
            loader.next_batch()
    state = ranks[0].state_dict()
    expected = [sample_ids(loader.next_batch()) for loader in ranks]

    single = DistributedBatchLoader(numbered, micro_batch_size=2, rank=0, world_size=1, seed=9)
    single.load_state_dict(state)
    assert sample_ids(single.next_batch()) == expected[0] + expected[1]


def test_eval_batches_are_fixed_sharded_and_leave_training_alone(numbered: PackedDataset) -> None:
    loaders = [DistributedBatchLoader(numbered, micro_batch_size=2, rank=r, world_size=2, seed=1)
               for r in (0, 1)]
    loader = loaders[1]
    loader.next_batch()
    state = loader.state_dict()
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()  # the documented order
    expected = [perm[2:4], perm[6:8]]
    assert [sample_ids(batch) for batch in loader.eval_batches()] == expected
    assert [sample_ids(batch) for batch in loader.eval_batches(1)] == expected[:1]
    assert [sample_ids(batch) for batch in loader.eval_batches()] == expected  # same samples every time
    both = [i for r in loaders for batch in r.eval_batches() for i in sample_ids(batch)]
    assert len(set(both)) == 8  # two global batches of 4 distinct samples, no overlap between ranks
    assert loader.state_dict() == state


def test_incompatible_loader_state_is_refused(numbered: PackedDataset) -> None:
    state = DistributedBatchLoader(numbered, micro_batch_size=2, rank=0, world_size=1, seed=1).state_dict()
    shorter = packed_from_rows([[100 + i, 10, 11] for i in range(6)])
    with pytest.raises(DataError, match="dataset_len: saved 10, now 6"):
        DistributedBatchLoader(shorter, micro_batch_size=2, rank=0, world_size=1, seed=1).load_state_dict(
            state
        )
    with pytest.raises(DataError, match="seed: saved 1, now 2"):
        DistributedBatchLoader(numbered, micro_batch_size=2, rank=0, world_size=1, seed=2).load_state_dict(
            state
        )
    with pytest.raises(DataError, match="fewer than one global micro-batch"):
        DistributedBatchLoader(shorter, micro_batch_size=4, rank=0, world_size=2, seed=1)


# --- input errors -----------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nowhere.*does not exist"):
        load_documents(config(tmp_path, name="files", path=str(tmp_path / "nowhere")))
    with pytest.raises(DataError, match="data.path=.*corpus.jsonl.* is set but data.name is 'stdlib'"):
        load_documents(config(tmp_path, name="stdlib", path=str(tmp_path / "corpus.jsonl")))
    with pytest.raises(DataError, match="tokenizer file .*absent.json does not exist"):
        load_or_train_tokenizer(config(tmp_path, tokenizer_path=str(tmp_path / "absent.json")), None)


def test_empty_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "empty.txt").write_text("")
    with pytest.raises(DataError, match="corpus .*corpus contains no non-empty documents"):
        load_documents(config(tmp_path, name="files", path=str(corpus)))


def test_unsupported_file_type(tmp_path: Path) -> None:
    table = tmp_path / "table.csv"
    table.write_text("text\nhello\n")
    with pytest.raises(DataError, match="table.csv: unsupported file type"):
        load_documents(config(tmp_path, name="files", path=str(table)))


def test_malformed_jsonl_line(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": "broken\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl:2: not valid JSON"):
        load_documents(config(tmp_path, name="files", path=str(corpus)))


def test_missing_text_field(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n{"body": "elsewhere"}\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl:2: no field 'text'"):
        load_documents(config(tmp_path, name="files", path=str(corpus)))


def test_corpus_too_short_for_one_sample(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="the train split has 12 tokens, fewer than one sample"):
        build_datasets(abcd_corpus(tmp_path, seq_len=64))


@pytest.mark.chaos
def test_a_cache_lock_wait_has_a_deadline_and_a_killed_holder_frees_it(tmp_path: Path) -> None:
    """A process that holds the lock of a cache entry it builds: a stuck one is waited for up to
    data.lock_timeout_s, then one line names the lock; `kill -9` releases it at once."""
    import signal
    import time

    from data.corpus import cache_lock

    entry = tmp_path / "tokenizers" / "abc.json"
    entry.parent.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from filelock import FileLock
        with FileLock({str(entry) + '.lock'!r}):
            print("held", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(DataError,
                           match=r"waited 0.5 s for .*abc\.json\.lock: another process holds it while it "
                                 r"builds the tokenizer"):
            with cache_lock(entry, 0.5, "tokenizer"):
                pass
        assert time.monotonic() - start < 5
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        with cache_lock(entry, 5, "tokenizer"):  # no stale lock after the kill
            pass
    finally:
        holder.kill()
        holder.wait(timeout=10)
