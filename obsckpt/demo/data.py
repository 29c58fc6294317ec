"""The demo's data: each rank reads a synthetic dataset through a torchdata StatefulDataLoader.

What a resume must bring back is all here, so that a resumed run that got any
of it wrong trains on other tokens (and the bit-exact check fails):

* the data position: a shuffling ``StatefulDataLoader`` per epoch, its
  ``state_dict()`` (and the epoch) saved in the resume record. Each epoch's
  loader is seeded from (seed, rank, epoch): torchdata 0.11 does not restore
  the generator a loader draws the *next* epoch's shuffle from;
* the RNGs: each batch is augmented with draws from Python's ``random`` (a
  shift of the start token), NumPy's global generator (a stride) and torch's
  (the order of the rows), seeded per rank by :func:`seed_rank`.
"""

from __future__ import annotations

import random
import warnings
import zlib
from typing import Any

import numpy as np
import torch

from obsckpt.demo.config import ModelSpec

# Samples per rank and epoch: a short demo crosses epochs.
DATASET_SIZE = 40
_STRIDES = (1, 2, 3)


def seed_rank(seed: int, rank: int) -> None:
    """Seed torch's, NumPy's and Python's generators for ``rank`` (each rank draws its own)."""
    value = (seed * 7919 + rank + 1) % 2**32
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)


class DemoData:
    """One rank's batches; ``state_dict()``/``load_state_dict()`` hold its position."""

    def __init__(self, spec: ModelSpec, *, seed: int, rank: int) -> None:
        self.spec = spec
        self.seed = seed
        self.rank = rank
        self.per_epoch = DATASET_SIZE // spec.batch_size
        self.epoch = 0
        self.served = 0  # batches of this epoch served
        self._loader = self._make(0)
        self._it: Any = None

    def _make(self, epoch: int) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + epoch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchdata's own deprecation warning
            return StatefulDataLoader(
                list(range(DATASET_SIZE)),
                batch_size=self.spec.batch_size,
                shuffle=True,
                drop_last=True,
                generator=gen,
            )

    def next_batch(self) -> torch.Tensor:
        """The next batch of token sequences (batch_size x seq_len)."""
        if self._it is None:
            self._it = iter(self._loader)
        indices = next(self._it)
        self.served += 1
        if self.served == self.per_epoch:
            # The next epoch's loader now, so a saved state never is an ended epoch's.
            self.epoch += 1
            self.served = 0
            self._loader, self._it = self._make(self.epoch), None
        return self._tokens(indices)

    def _tokens(self, indices: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        rows = []
        for index in indices.tolist():
            gen = torch.Generator().manual_seed(
                self.seed * 1_000_003 + (self.rank * DATASET_SIZE + index) * 1_009
            )
            start = int(torch.randint(spec.vocab_size, (1,), generator=gen))
            stride = _STRIDES[int(torch.randint(len(_STRIDES), (1,), generator=gen))]
            start += random.randrange(8)  # Python's generator
            if np.random.rand() < 0.5:  # NumPy's
                stride = _STRIDES[np.random.randint(len(_STRIDES))]
            rows.append((start + stride * torch.arange(spec.seq_len)) % spec.vocab_size)
        batch = torch.stack(rows)
        return batch[torch.randperm(len(rows))]  # torch's

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "served": self.served, "loader": self._loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.served = int(state["epoch"]), int(state["served"])
        self._loader = self._make(self.epoch)
        self._loader.load_state_dict(state["loader"])
        self._it = None


def digest(tokens: torch.Tensor) -> str:
    """CRC32 of a batch's tokens, to compare data order between runs."""
    return f"{zlib.crc32(tokens.detach().cpu().contiguous().numpy().tobytes()):08x}"
