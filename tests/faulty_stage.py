"""A test-only stage that breaks the stage contract as asked: what a user's own stage may do wrong."""
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from stages.base import Batch, BatchContext, DataKind, Role, Spec, Stage, StageError

FAULTS = {  # what each fault makes of a batch's (data, labels, paths)
    "short": lambda data, labels, paths: (data[:, 1:], labels, paths),  # one row too few
    "dtype": lambda data, labels, paths: (data.astype(np.float32), labels, paths),
    "list": lambda data, labels, paths: (list(data), labels, paths),
    "labels short": lambda data, labels, paths: (data, labels[1:], paths),
    "labels a list": lambda data, labels, paths: (data, list(labels), paths),
    "labels float": lambda data, labels, paths: (data, labels.astype(np.float64), paths),
    "labels a column": lambda data, labels, paths: (data, labels[:, None], paths),
    "no paths": lambda data, labels, paths: (data, labels, None),
    "paths not str": lambda data, labels, paths: (data, labels, [Path(path) for path in paths]),
    "labels past the classes": lambda data, labels, paths: (data, labels + 4, paths),
    "twice": lambda data, labels, paths: (np.concatenate([data, data]), np.concatenate([labels, labels]), paths * 2),
}


@dataclass
class Faulty(Stage):
    fault: str = "short"  # one of FAULTS; "nothing": returns None; "raise": a bug; "refuse": a StageError;
    #                       "init": a bug as it is made; "reject": leaves out its batch's first file (ctx.reject)

    role: ClassVar[Role] = Role.MAP
    accepts: ClassVar[DataKind | None] = DataKind.TENSOR

    def __post_init__(self) -> None:
        if self.fault == "init":
            len(self.fault.encode()[0])  # a TypeError of its own

    def output_spec(self, input_spec: Spec | None) -> Spec:
        return input_spec

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        if self.fault == "raise":
            raise ZeroDivisionError("a bug of the stage's own")
        if self.fault == "refuse":
            raise StageError("this batch cannot be brightened; lower strength")
        if self.fault == "nothing":
            return None
        if self.fault == "reject":
            ctx.reject(batch.paths[0], "rejected by the test's stage")
            return Batch(batch.data[1:], batch.labels[1:], batch.paths[1:])
        return Batch(*FAULTS[self.fault](batch.data, batch.labels, batch.paths))


@dataclass
class Oblong(Stage):
    """Declares half the width it is given (and makes it): a tensor that is not square."""

    role: ClassVar[Role] = Role.MAP
    accepts: ClassVar[DataKind | None] = DataKind.TENSOR

    def output_spec(self, input_spec: Spec | None) -> Spec:
        height, width, channels = input_spec.item_shape
        return Spec(DataKind.TENSOR, (height, width // 2, channels))

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        return Batch(batch.data[:, :, ::2].copy(), batch.labels, batch.paths)


@dataclass
class ImagesSink(Stage):
    """A sink of decoded images, each of its own size."""

    role: ClassVar[Role] = Role.SINK
    accepts: ClassVar[DataKind | None] = DataKind.IMAGES

    def output_spec(self, input_spec: Spec | None) -> Spec:
        return input_spec

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        return batch
