"""A progress bar with ETA on rank 0 (tqdm), silent elsewhere."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


class Progress:
    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                        file=sys.stderr, disable=not enabled, smoothing=0.1)

    def update(self, loss: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.bar.update(1)

    def note(self, text: str) -> None:
        if not self.bar.disable:
            self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
