"""CheckpointManager: atomic saves, verification, fallback, keep-last-K (no DeepSpeed needed)."""
import warnings
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import CheckpointError, CheckpointManager, tag_for, verify


class FakeEngine:
    """Writes and reads one file the way DeepSpeed does: <dir>/<tag>/..."""

    def __init__(self, value: float = 0.0):
        self.value = value

    def save_checkpoint(self, save_dir, tag, save_latest=True):
        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"value": self.value}, path / "mp_rank_00_model_states.pt")

    def load_checkpoint(self, load_dir, tag, **kw):
        self.value = torch.load(Path(load_dir) / tag / "mp_rank_00_model_states.pt")["value"]
        return str(Path(load_dir) / tag), {}


def save(mgr, step):
    mgr.save(FakeEngine(float(step)), step, {"step": step}, {"rng": step})


def test_save_is_complete_and_prunes(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, rank=0)
    for step in (1, 2, 3):
        save(mgr, step)
    assert [p.name for p in mgr.checkpoints()] == [tag_for(2), tag_for(3)]
    assert (tmp_path / "latest").read_text() == tag_for(3)
    assert verify(tmp_path / tag_for(3)) is None
    assert not list(tmp_path.glob(".tmp_*"))
    engine = FakeEngine()
    trainer_state, rank_state = mgr.load(engine, mgr.find_latest_valid())
    assert engine.value == 3.0 and trainer_state == {"step": 3} and rank_state == {"rng": 3}


@pytest.mark.chaos
def test_interrupted_saves_are_ignored(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=5, rank=0)
    save(mgr, 1)
    # killed while DeepSpeed was writing step 2: only a temp dir exists
    FakeEngine().save_checkpoint(tmp_path / ".tmp_step_00000002", tag_for(2))
    # killed after the rename but before the manifest was written (cannot happen with our order,
    # but a copy tool might produce it): a step dir without a manifest
    (tmp_path / tag_for(3)).mkdir()
    (tmp_path / tag_for(3) / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    with pytest.warns(UserWarning, match="step_00000003.*no manifest"):
        assert mgr.find_latest_valid() == tmp_path / tag_for(1)
    save(mgr, 2)  # the next save clears the stale temp dir
    assert not (tmp_path / ".tmp_step_00000002").exists()
    assert (tmp_path / "step_00000003.corrupt").is_dir()


@pytest.mark.chaos
def test_corruption_is_detected_and_quarantined(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=5, rank=0)
    save(mgr, 1)
    save(mgr, 2)
    f = tmp_path / tag_for(2) / "mp_rank_00_model_states.pt"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    f.write_bytes(bytes(data))
    assert "checksum" in verify(tmp_path / tag_for(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.find_latest_valid() == tmp_path / tag_for(1)
    assert any("step_00000002" in str(w.message) for w in caught)
    assert (tmp_path / "step_00000002.corrupt").is_dir()
    save(mgr, 2)
    save(mgr, 3)
    assert (tmp_path / "step_00000002.corrupt").is_dir()  # pruning never touches quarantined dirs


def test_resolve_explicit_paths(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=5, rank=0)
    assert mgr.resolve("auto") is None and mgr.resolve("none") is None
    save(mgr, 4)
    assert mgr.resolve(str(tmp_path / "ck" / tag_for(4))) == tmp_path / "ck" / tag_for(4)
    assert mgr.resolve(str(tmp_path / "ck")) == tmp_path / "ck" / tag_for(4)
    with pytest.raises(CheckpointError, match="no such"):
        mgr.resolve(str(tmp_path / "nowhere"))
    (tmp_path / "ck" / tag_for(4) / "trainer_state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unusable"):
        mgr.resolve(str(tmp_path / "ck" / tag_for(4)))


class _RunsCode:
    """Unpickles as a call of os.system: what a hostile checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


@pytest.mark.chaos
@pytest.mark.parametrize("where", ["trainer_state.pt", "unlisted.pt", "legacy"])
def test_checkpoint_pickling_code_is_refused_unread(tmp_path, where):
    """A checkpoint whose pickles name anything but data (here os.system) is refused before any
    of it is unpickled, wherever the file sits: DeepSpeed finds its files by name, not through
    our manifest. A legacy (non-zip) torch file, which torch.load would read as a plain pickle,
    too. resolve names the file; 'auto' falls back to the previous checkpoint."""
    from trainer.checkpoint import write_manifest

    mgr = CheckpointManager(tmp_path / "ck", keep_last=5, rank=0)
    save(mgr, 1)
    save(mgr, 2)
    ckpt, marker = tmp_path / "ck" / tag_for(2), tmp_path / "ran"
    payload = {"step": 2, "x": _RunsCode(marker)}
    if where == "legacy":
        torch.save(payload, ckpt / "trainer_state.pt", _use_new_zipfile_serialization=False)
    else:
        torch.save(payload, ckpt / where)
    if where != "unlisted.pt":
        write_manifest(ckpt, 2)  # the manifest agrees: the checksums are not what stops it
    with pytest.raises(CheckpointError, match="refused|not a torch checkpoint file") as err:
        mgr.resolve(str(ckpt))
    assert len(str(err.value).splitlines()) == 1
    assert ("unlisted.pt" if where == "unlisted.pt" else "trainer_state.pt") in str(err.value)
    with pytest.warns(UserWarning, match="step_00000002"):
        assert mgr.find_latest_valid() == tmp_path / "ck" / tag_for(1)
    assert not marker.exists()


def test_saved_states_load_as_data_only(tmp_path):
    """What the trainer writes (RNG states with numpy arrays included) passes the check and loads
    back."""
    import numpy as np

    from trainer.checkpoint import unsafe_pickle_globals
    mgr = CheckpointManager(tmp_path, keep_last=2, rank=0)
    rng = {"numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    mgr.save(FakeEngine(1.0), 1, {"step": 1, "config": {"a": 1}}, {"rng": rng})
    ckpt = tmp_path / tag_for(1)
    assert verify(ckpt) is None
    assert all(unsafe_pickle_globals(p) == [] for p in ckpt.glob("*.pt"))
    _, rank_state = mgr.load(FakeEngine(), ckpt)
    assert np.array_equal(rank_state["rng"]["numpy"][1], rng["numpy"][1])


@pytest.mark.chaos
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """The disk fills while the engine writes its files: one line naming the checkpoint that is
    still good, the half-written one removed (its space given back), `latest` unmoved, and the
    next resume finds the previous checkpoint intact."""
    import errno

    class FullDisk(FakeEngine):
        def save_checkpoint(self, save_dir, tag, save_latest=True):
            path = Path(save_dir) / tag
            path.mkdir(parents=True, exist_ok=True)
            (path / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")

    mgr = CheckpointManager(tmp_path, keep_last=5, rank=0)
    save(mgr, 1)
    with pytest.raises(CheckpointError) as err:
        mgr.save(FullDisk(2.0), 2, {"step": 2}, {"rng": 2})
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert "No space left on device" in message and f"{tag_for(1)} is intact" in message
    assert not list(tmp_path.glob(".tmp_*")) and not (tmp_path / tag_for(2)).exists()
    assert (tmp_path / "latest").read_text() == tag_for(1)
    assert mgr.find_latest_valid() == tmp_path / tag_for(1)
