"""A test-only stage that breaks the stage contract as asked: what a user's own stage may do wrong."""
from dataclasses import dataclass
from typing import ClassVar

from stages.base import Batch, BatchContext, DataKind, Role, Spec, Stage


@dataclass
class Faulty(Stage):
    fault: str = "short"  # short: one row too few | dtype: float32 | list: a list of arrays | labels: one short
    #                       | nothing: returns None | raise: a bug

    role: ClassVar[Role] = Role.MAP
    accepts: ClassVar[DataKind | None] = DataKind.TENSOR

    def output_spec(self, input_spec: Spec | None) -> Spec:
        return input_spec

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        data, labels = batch.data, batch.labels
        if self.fault == "raise":
            raise ZeroDivisionError("a bug of the stage's own")
        if self.fault == "nothing":
            return None
        if self.fault == "short":
            data = data[:, 1:]
        elif self.fault == "dtype":
            data = data.astype("float32")
        elif self.fault == "list":
            data = list(data)
        elif self.fault == "labels":
            labels = labels[1:]
        return Batch(data, labels, batch.paths)
