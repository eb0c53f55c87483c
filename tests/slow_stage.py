"""A test-only stage that takes its time, so a test can kill a busy worker."""
import time
from dataclasses import dataclass
from typing import ClassVar

from stages.base import Batch, BatchContext, DataKind, Role, Spec, Stage


@dataclass
class SlowDown(Stage):
    seconds: float = 0.3  # sleep per batch

    role: ClassVar[Role] = Role.MAP
    accepts: ClassVar[DataKind | None] = DataKind.IMAGES

    def output_spec(self, input_spec: Spec | None) -> Spec:
        return Spec(DataKind.IMAGES)

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        time.sleep(self.seconds)
        return batch
