"""Broadcast stage: the DAG's sinks. Models name a sink as their `input`; its
batches are fanned out to every trainer of every model that reads it. Which
collective carries them there (one producer, shares gathered from every
node, one producer per stream: docs/topologies.md) is the topology's
business, not the stage's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stages.base import Batch, BatchContext, DataKind, Role, Spec, Stage


@dataclass
class Broadcast(Stage):
    """The end of a branch: its finished uint8 batches, unchanged, are handed
    to every model whose `input` names this stage."""

    role: ClassVar[Role] = Role.SINK
    accepts: ClassVar[DataKind | None] = DataKind.TENSOR

    def output_spec(self, input_spec: Spec | None) -> Spec:
        assert input_spec is not None
        return input_spec

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        assert batch is not None
        return batch
