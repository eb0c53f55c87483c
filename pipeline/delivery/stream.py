"""The transport seam: how finished batches reach the trainers of a flotilla.

A hub publishes each finished batch of a stream once per sink; every reader
of a sink's ring receives every message, in order, exactly once. On a node, bytes move
through shared-memory rings (ring.py); between nodes, hubs exchange batches over
torch.distributed collectives (collective.py) and each writes its node's rings.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np


class MessageKind(enum.IntEnum):
    BATCH = 0  # images + labels of one batch
    END = 1  # the split of this epoch is complete
    STOP = 2  # no more messages: the run is over


@dataclass(frozen=True)
class MessageLayout:
    """Fixed message geometry, declared before any data flows."""

    batch_capacity: int  # most images in one message
    item_shape: tuple[int, ...]  # (height, width, channels), uint8

    @property
    def item_bytes(self) -> int:
        return int(np.prod(self.item_shape))


@dataclass
class Message:
    kind: MessageKind
    split: int  # index into stages.base.Split
    epoch: int
    index: int  # batch index within the split's epoch
    images: np.ndarray  # [n, *item_shape] uint8; a zero-copy view valid until release()
    labels: np.ndarray  # [n] int64, a view like images
    release: Callable[[], None]  # hand the buffer back; call once done with the arrays


class StreamReader(ABC):
    """The consumer end, picklable so that it can be given to a trainer process."""

    @abstractmethod
    def messages(self, idle: Callable[[], None] | None = None) -> Iterator[Message]:
        """Every message of its sink of the stream, in order; stops after STOP. While it waits for one, `idle` is
        called every few milliseconds (a trainer obeys the driver's commands between epochs)."""


class StreamWriter(ABC):
    @abstractmethod
    def publish(self, kind: MessageKind, split: int, epoch: int, index: int,
                images: np.ndarray | None = None, labels: np.ndarray | None = None) -> None:
        """Blocks while the slowest reader is a full buffer behind (back-pressure)."""
