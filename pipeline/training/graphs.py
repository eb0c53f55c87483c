"""A unit's training step, or its validation forward, as a CUDA graph: captured once, then replayed as one
launch.

On a GPU a small model's eager step is bound by kernel launches: at 64 px one ResNet-18 keeps an H100
busy a quarter of the time, and a packed slot, stepping its members in turn from one thread, trains at
one model's speed whatever its size (docs/benchmarks.md, slot groups). A replayed graph runs the step's
hundreds of kernels back to back, without Python or the driver between them.

Whole-step capture follows torch's rules (torch.cuda.graphs): nothing in the step waits for the host; the
learning rate is a tensor on the device that the schedule fills (a float would be baked into the graph);
every batch is copied into static tensors of its shape (`StaticInputs`), which the graphs read.
A unit's first steps run eagerly (cuDNN and cuBLAS choose their kernels, the optimiser makes its
momentum). A unit has a graph per batch shape, at most SHAPES of them: an epoch's last, smaller batch is
stepped eagerly the first time it comes and replayed from the next epoch on (eager, it cost the paper
ensemble 1.9-2.3 s an epoch, 100 models' kernels launched one by one).

The units that step on one CUDA stream (all of a group's, or each of its streams' share:
GroupSpec.cuda_streams) capture into one memory pool. That is safe because their graphs replay one at a
time on that stream and keep nothing in the pool from one replay to the next (weights, momentum, inputs
and the losses handed out live outside it), and it keeps a stream's memory at one member's activations at
a time. Streams that run at once have pools of their own.
"""
from __future__ import annotations

EAGER_STEPS = 3  # before a unit's first capture: torch's graph examples warm up with three
SHAPES = 2  # batch shapes a sink's graphs take: an epoch's batches, and its last, smaller one


def shape_of(*tensors) -> tuple:
    """What a graph's inputs must match: shapes and layout."""
    return tuple((tuple(t.shape), tuple(t.stride())) for t in tensors)


class StaticInputs:
    """Static tensors per sink and batch shape on the device (x and y to train on, x to validate on), the
    graphs' inputs: each batch of a known shape is copied in, and the copy is what every unit of the group
    reads (one copy per sink and step). A sink's first SHAPES shapes are known."""

    def __init__(self):
        self._static: dict[str, dict[tuple, tuple]] = {}  # sink -> shape -> tensors

    def take(self, sink: str, *batch) -> tuple:
        """(*tensors, staged): the static tensors now holding `batch`, staged True; or `batch` itself,
        False, when its sink has SHAPES other shapes already."""
        known, shape = self._static.setdefault(sink, {}), shape_of(*batch)
        static = known.get(shape)
        if static is None:
            if len(known) >= SHAPES:
                return *batch, False
            known[shape] = static = tuple(t.clone() for t in batch)  # clones keep x's layout (channels_last)
            return *static, True
        for target, tensor in zip(static, batch):
            target.copy_(tensor)
        return *static, True


def stage(static: StaticInputs | None, batches: dict[str, tuple]) -> dict[str, tuple]:
    """sink -> (*tensors, staged): each sink's batch copied once into the graphs' inputs where it has
    their shape (`StaticInputs.take`); as it is, staged False, without graphs."""
    if static is None:
        return {sink: (*batch, False) for sink, batch in batches.items()}
    return {sink: static.take(sink, *batch) for sink, batch in batches.items()}


class StepGraph:
    """A unit's step on static inputs of one or more shapes: eager for the unit's first EAGER_STEPS and
    for the first step of each later shape, then captured, a graph per shape, and replayed. `step(*inputs)`
    is the unit's eager step (its output on the device: losses, or validation's probabilities); `pool` is
    shared by the graphs of the units on the unit's stream; `stream`, where given, is that stream, which
    captures (else torch's one side stream): cuBLAS keeps a workspace per stream, and a graph replays the
    one its capture used, so graphs that run at once must be captured on streams of their own; `names` (the unit's
    members) name it in errors."""

    def __init__(self, step, pool, names, stream=None):
        self._step, self._pool, self._names, self._stream = step, pool, names, stream
        self._eager_steps = 0
        self._stepped: set[tuple] = set()  # shapes stepped eagerly
        self._graphs: dict[tuple, tuple] = {}  # shape -> (graph, the captured step's output, rewritten by replays)

    @property
    def captured(self) -> list[tuple]:
        """The shapes captured so far."""
        return list(self._graphs)

    def __call__(self, *inputs):
        """One step on static inputs, the same tensors at every call with their shape."""
        shape = shape_of(*inputs)
        if shape not in self._graphs and (self._eager_steps < EAGER_STEPS or shape not in self._stepped):
            self._eager_steps += 1
            self._stepped.add(shape)
            return self._step(*inputs)
        if shape not in self._graphs:
            self._graphs[shape] = self._capture(inputs)
        graph, output = self._graphs[shape]
        graph.replay()
        return output.clone()  # the next replay rewrites the graph's own

    def _capture(self, inputs) -> tuple:
        import torch

        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the trainer's checkpoint writer may be copying kept states to the host meanwhile
            # (KeptStates.to_host, on a stream of its own), which the default, global mode forbids
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                output = self._step(*inputs)  # recorded, not run: the replay that follows runs it
        except RuntimeError as error:  # e.g. a model that reads a value on the host, or changes shape
            raise RuntimeError(f"the step of {', '.join(self._names)} cannot be captured as a CUDA graph "
                               f"({error}); set trainer.cuda_graphs=false to train eagerly") from error
        return graph, output
