"""Sink stage: the end of a branch; its name is the stream models subscribe to."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stages.base import Batch, BatchContext, DataKind, Role, Spec, Stage


@dataclass
class Deliver(Stage):
    """Hands finished uint8 batches to the transport, which carries them to
    every trainer of the models whose `input` names this stage."""

    role: ClassVar[Role] = Role.SINK
    accepts: ClassVar[DataKind | None] = DataKind.TENSOR

    def output_spec(self, input_spec: Spec | None) -> Spec:
        assert input_spec is not None
        return input_spec

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        assert batch is not None
        return batch
