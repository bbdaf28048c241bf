"""Deterministic, resumable micro-batches of a packed split, sharded over data-parallel ranks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from data.errors import DataError
from data.packing import PackedDataset

# `state_dict` fields that must match for a saved position to mean the same samples.
_IDENTITY_KEYS = ("dataset_len", "seed", "shuffle")


class DistributedBatchLoader:
    """Serves this rank's share of each global micro-batch, epoch after epoch.

    Each epoch visits the samples in a permutation drawn from ``seed + epoch`` (identity order without
    `shuffle`). A global micro-batch is the next ``micro_batch_size * world_size`` entries of that order;
    rank ``r`` takes the ``r``-th block of ``micro_batch_size``, so ranks never share a sample and together
    see exactly what a single process with the global batch would. The incomplete last global batch
    of an epoch is dropped and the next epoch starts on its own.

    The position is counted in global samples, so a checkpoint taken with one world size resumes with
    another on the same sample order. Iterating yields batches forever; the trainer decides when to stop.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.global_batch_size = micro_batch_size * world_size
        if len(dataset) < self.global_batch_size:
            raise DataError(
                f"the split has {len(dataset)} samples, fewer than one global micro-batch of "
                f"{micro_batch_size} x {world_size} ranks = {self.global_batch_size}"
            )
        self.epoch = 0
        self.position = 0  # global samples of the current epoch already served
        self._order_epoch = -1
        self._order = torch.empty(0, dtype=torch.int64)

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's next micro-batch: ``input_ids``, ``labels``, ``doc_ids`` of shape
        [micro_batch_size, seq_len]."""
        # Rolled over here rather than after serving, so that a position restored under a larger
        # world size than it was saved with is handled in the same place.
        if self.position + self.global_batch_size > len(self.dataset):
            self.epoch += 1
            self.position = 0
        start = self.position + self.rank * self.micro_batch_size
        indices = self._epoch_order()[start : start + self.micro_batch_size]
        self.position += self.global_batch_size
        return self.dataset.get_batch(indices.tolist())

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def eval_batches(self, num_batches: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's share of `num_batches` global micro-batches (0: all) of a fixed sample order.

        The order is one permutation drawn from `seed` (so a partial pass samples the whole split, not
        just its first documents), independent of the training position and of `shuffle`: every
        evaluation of a run sees the same samples.
        """
        if num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches}")
        available = len(self.dataset) // self.global_batch_size
        count = available if num_batches == 0 else min(num_batches, available)
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed))
        for batch in range(count):
            start = batch * self.global_batch_size + self.rank * self.micro_batch_size
            yield self.dataset.get_batch(order[start : start + self.micro_batch_size].tolist())

    def state_dict(self) -> dict[str, Any]:
        """Where the sample stream stands, as plain ints and bools (safe in any checkpoint format)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": len(self.dataset),
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the last batch served when `state` was saved.

        `world_size` and `micro_batch_size` may differ from the saved ones; the data may not.
        """
        current = self.state_dict()
        missing = [key for key in ("epoch", "position", *_IDENTITY_KEYS) if key not in state]
        if missing:
            raise DataError(f"data loader state lacks the keys {missing}")
        changed = [
            f"{key}: saved {state[key]!r}, now {current[key]!r}"
            for key in _IDENTITY_KEYS
            if state[key] != current[key]
        ]
        if changed:
            raise DataError(f"data loader state does not match this dataset ({'; '.join(changed)})")
        if state["epoch"] < 0 or not 0 <= state["position"] <= len(self.dataset):
            raise DataError(
                f"data loader state has an invalid position: epoch {state['epoch']}, position "
                f"{state['position']}"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

    def _epoch_order(self) -> torch.Tensor:
        """The sample order of the current epoch, drawn once per epoch."""
        if self._order_epoch != self.epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(len(self.dataset), generator=generator)
            else:
                self._order = torch.arange(len(self.dataset))
            self._order_epoch = self.epoch
        return self._order


class MixedBatchLoader:
    """Micro-batches from two loaders, text and image-text, by a fixed share: micro-batch k (counted
    from the start of training, the same on every rank) comes from the image-text loader when
    floor((k + 1) * ratio) > floor(k * ratio), so any window of them holds the share to within one.
    Each loader keeps its own position; the state holds both and k."""

    def __init__(self, text: DistributedBatchLoader, images: DistributedBatchLoader, ratio: float) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"the image-text share must be in (0, 1], got {ratio}")
        self.text, self.images, self.ratio = text, images, ratio
        self.served = 0

    def next_batch(self) -> dict[str, Any]:
        k, self.served = self.served, self.served + 1
        from_images = int((k + 1) * self.ratio) > int(k * self.ratio)
        return (self.images if from_images else self.text).next_batch()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            yield self.next_batch()

    def eval_batches(self, num_batches: int = 0) -> Iterator[dict[str, Any]]:
        return self.text.eval_batches(num_batches)

    def state_dict(self) -> dict[str, Any]:
        return {"served": self.served, "ratio": self.ratio, "text": self.text.state_dict(),
                "images": self.images.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "images" not in state:
            raise DataError("the checkpoint's data position is of a text-only run; data.image_text_ratio "
                            f"= {self.ratio} needs one of a mixed run")
        if state["ratio"] != self.ratio:
            raise DataError(f"data.image_text_ratio: the checkpoint was taken with {state['ratio']}, now "
                            f"{self.ratio}")
        self.text.load_state_dict(state["text"])
        self.images.load_state_dict(state["images"])
        self.served = int(state["served"])
