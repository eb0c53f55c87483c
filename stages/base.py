"""The stage contract.

A stage is a dataclass whose fields are its configuration (the dataclass is
also the config schema: Hydra entries are checked against it) and whose
`output_spec` says what it produces before any data flows, so that a graph
can be validated on the driver. Stages know nothing of Dask, trainers or
the scheduler: they turn one batch into the next, given a `BatchContext`.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import random
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from pipeline.runtime.errors import UserError


class Role(str, enum.Enum):
    SOURCE = "source"  # no inputs: makes a batch from a batch index
    MAP = "map"  # one input batch in, one out
    SINK = "sink"  # end of a branch, a broadcast stage: its batches are fanned out to trainers


class DataKind(str, enum.Enum):
    ENCODED = "encoded"  # file bytes, as read
    IMAGES = "images"  # decoded HWC uint8 RGB images of any size
    TENSOR = "tensor"  # one NHWC uint8 array, every image the same shape


@dataclass(frozen=True)
class Spec:
    """What flows out of a stage: the kind of data and, for tensors, the item shape."""

    kind: DataKind
    item_shape: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return self.kind.value + (f"{list(self.item_shape)}" if self.item_shape else "")

    def broken_by(self, batch, most: int, classes: int) -> str | None:
        """How `batch`, a stage's output, is not what this spec promises the stages after it (None: it is),
        as a whole (a few looks, whatever its size): a Batch of at most `most` items (what a batch task
        holds), a list of paths and one int64 array of labels, one of each per item, each label one of the
        `classes`; a tensor's one uint8 array of every item, of this item shape."""
        if not isinstance(batch, Batch):
            return f"returned {_described(batch)}, not a stages.base.Batch"
        if not (isinstance(batch.data, list) or isinstance(batch.data, np.ndarray) and batch.data.ndim):
            return f"made {_described(batch.data)}, not a list of items or one array of them"
        labels = batch.labels
        if not (isinstance(labels, np.ndarray) and labels.dtype == np.int64 and labels.ndim == 1):
            return f"made labels that are {_described(labels)}, not one int64 array of a label per item"
        if not isinstance(batch.paths, list):
            return f"made paths that are {_described(batch.paths)}, not a list of a path (str) per item"
        if not len(batch.data) == len(labels) == len(batch.paths):
            return (f"made {len(batch.data)} items with {len(labels)} labels and {len(batch.paths)} paths "
                    "(a Batch has one label and one path per item)")
        if len(labels) > most:
            return f"made {len(labels)} items, more than a batch task holds ({most})"
        if len(labels) and not 0 <= labels.min() <= labels.max() < classes:
            return f"made labels from {labels.min()} to {labels.max()}, not class indices of the {classes} classes"
        if self.kind is DataKind.TENSOR:
            shape = (len(labels), *self.item_shape)
            data = batch.data
            if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.shape == shape):
                return f"made {_described(data)}, not the {self} it declares (one uint8 array of shape {list(shape)})"
        return None

    def items_broken_by(self, batch: Batch) -> str | None:
        """How an item of `batch`, whole as `broken_by` holds it, is not what this spec promises: a path that
        is not a str, an image not RGB uint8 (height x width x 3), a file not bytes. A look at each item: work
        per image, so the graph asks it of a user's stages only."""
        if not all(isinstance(path, str) for path in batch.paths):
            return f"made paths that are {_described(batch.paths)}, not a list of a path (str) per item"
        if self.kind is DataKind.IMAGES:
            for path, item in zip(batch.paths, batch.data):
                if not (isinstance(item, np.ndarray) and item.dtype == np.uint8 and item.ndim == 3
                        and item.shape[2] == 3):
                    return (f"made {_described(item)} of {path}, not the RGB image it declares (uint8, height x "
                            "width x 3)")
        elif self.kind is DataKind.ENCODED and not all(isinstance(item, bytes) for item in batch.data):
            return "made items that are not bytes, not the encoded files it declares"
        return None


def _described(value) -> str:
    """What a stage made, in a message: an array's dtype and shape, else its type."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype} {list(value.shape)}"
    return f"a {type(value).__name__}"


class OnError(enum.StrEnum):
    """What a data file that cannot be used does (config key `on_error`)."""

    skip = "skip"  # left out of its batch, counted and listed in results.json
    fail = "fail"  # stops the run, naming the file


class Split(str, enum.Enum):
    TRAIN = "train"
    VAL = "val"


@dataclass
class Batch:
    """Data of one batch between stages; `data` changes kind stage by stage."""

    data: list | np.ndarray
    labels: np.ndarray  # int64 class indices, one per item of `data`
    paths: list[str]  # source file of every item, for error reports


@dataclass
class BatchContext:
    """Everything a stage may know about the batch it is working on."""

    seed: int
    split: Split
    epoch: int
    index: int
    sequence: int = 0  # which sequence of epochs (each flotilla reads its own): it keys shuffles and augmentation
    part: int = 0  # this task makes share `part` of `parts` (contiguous chunks of the batch's items)
    parts: int = 1
    stage: str = ""  # name of the stage now running, set by the executor
    root: str = ""  # the source's prefix (ImageFolder.prefix), set by the graph: item_rng leaves it out
    node: int = 0  # the node whose worker runs the task (its cache store)
    wanted: list[tuple[str, int]] | None = None  # with a cache stage: the task's items (path, label), in order,
    held: dict[str, np.ndarray] = field(default_factory=dict)  # and the decoded images it holds of them
    on_error: OnError = OnError.skip  # what a bad data file does
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    converted: list[tuple[str, str]] = field(default_factory=list)  # (path, what was done)

    def reject(self, path: str, reason: str) -> None:
        """A data file cannot be used: record it, or stop the run naming it."""
        if self.on_error == OnError.fail:
            raise BadFileError(f"{path}: {reason} (on_error=fail; set on_error=skip to skip such files "
                               "and list them in results.json)")
        self.skipped.append((path, reason))

    def share(self, items: list) -> list:
        """This task's chunk of the batch's items: chunks in part order make the batch."""
        size = -(-len(items) // self.parts)
        return items[self.part * size:(self.part + 1) * size]

    def item_rng(self, path: str) -> random.Random:
        """A generator fixed by (seed, sequence, split, epoch, stage, file): an item gets the
        same augmentation whichever worker makes it, in whichever share of
        whichever batch, however often. The file is named by its path inside the
        dataset's folder, so a dataset that lies elsewhere (another machine, a
        copy) trains the same. Python's generator: one is made per image, and it
        is made about 5x faster than numpy's."""
        name = path[len(self.root):] if self.root and path.startswith(self.root) else path
        key = f"{self.seed}/{self.sequence}/{self.split.value}/{self.epoch}/{self.stage}/{name}".encode()
        return random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))


class StageError(UserError):
    """Bad stage configuration."""


class BadFileError(UserError):
    """A data file that cannot be used, under on_error=fail."""


class Stage:
    """Base of all stages. Subclasses are dataclasses; set `role` and `accepts`."""

    role: ClassVar[Role]
    accepts: ClassVar[DataKind | None]  # kind of input it takes; None for sources
    same_every_epoch: ClassVar[bool] = False  # what it makes of a file is the same every epoch (a cache may follow)

    def output_spec(self, input_spec: Spec | None) -> Spec:
        raise NotImplementedError

    def min_input_side(self) -> int | None:
        """Shorter image side this stage needs to lose no detail; None: full size."""
        return None

    def set_consumer_need(self, side: int | None) -> None:
        """Told by the graph what its consumers need (see `min_input_side`)."""

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        raise NotImplementedError

    @classmethod
    def config_fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]
