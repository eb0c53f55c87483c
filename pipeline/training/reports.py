"""What a trainer tells the driver, over its node's queue: one typed report
per event (they pickle across processes and hosts)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

Checksum = tuple[int, int, int, int, int]  # (message kind, split, epoch, index, CRC of images and labels)
PROBABILITY_FLOOR = 1e-12  # a softmax rounded to 0 for the true class costs -log of this, not infinity


@dataclass(frozen=True)
class TrainReport:
    """An epoch's training split is done (every rank sends one per model of its group)."""

    model: str
    rank: int
    epoch: int  # the model's own epoch count, whichever flotilla it trains in
    loss: float  # mean training loss of this rank's rows
    images: int  # rows this rank trained on
    step_s: float  # inside training steps
    wait_s: float  # waiting for the next batch
    spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of the group's steps,
    # time.time(); sent with the first member's report only
    lr: float | None = None  # its learning rate as the epoch ended (its optimiser's first param group)
    compile_s: float = 0.0  # of step_s, the group's steps that compiled (trainer.compile): since the last report


@dataclass(frozen=True)
class ValReport:
    """An epoch's validation is done (rank 0 only); the model's state after it is kept, to be
    checkpointed if the driver asks (CheckpointSaved)."""

    model: str
    epoch: int
    accuracy: float
    probs: np.ndarray  # softmax of every validation image, in delivery order
    labels: np.ndarray


def validation_loss(summed_probs: np.ndarray, labels: np.ndarray, count: int = 1) -> float:
    """Cross-entropy of the mean of `count` softmaxes (summed) against `labels`, NaN without labels: whatever
    loss the members trained with, validation compares them, and ensembles of them, on one scale."""
    if not len(labels):
        return float("nan")
    chosen = summed_probs[np.arange(len(labels)), labels].astype(np.float64) / count
    return float(-np.log(np.maximum(chosen, PROBABILITY_FLOOR)).mean())


@dataclass(frozen=True)
class CheckpointSaved:
    """checkpoints/<model>/epoch<epochs>.pt is written (rank 0, on the driver's SaveCheckpoint)."""

    group: str
    model: str
    epochs: int


@dataclass(frozen=True)
class ResumedEarlier:
    """The group's members resume after `epochs` epochs, not the `asked` ones: a trainer died before it wrote
    their checkpoints then (rank 0 only). The epochs between are trained again."""

    group: str
    models: tuple[str, ...]
    asked: int
    epochs: int


@dataclass(frozen=True)
class TrainerDone:
    """The rings said STOP; with trainer.record_checksums, what this rank received of each sink."""

    group: str
    rank: int
    checksums: dict[str, list[Checksum]]


@dataclass(frozen=True)
class TrainerError:
    group: str
    rank: int
    traceback: str


TrainerReport = TrainReport | ValReport | CheckpointSaved | ResumedEarlier | TrainerDone | TrainerError
