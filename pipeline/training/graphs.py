"""A unit's training step as a CUDA graph: captured once, then replayed as one launch.

On a GPU a small model's eager step is bound by kernel launches: at 64 px one ResNet-18 keeps an H100
busy a quarter of the time, and a packed slot, stepping its members in turn from one thread, trains at
one model's speed whatever its size (docs/benchmarks.md, slot groups). A replayed graph runs the step's
hundreds of kernels back to back, without Python or the driver between them.

Whole-step capture follows torch's rules (torch.cuda.graphs): nothing in the step waits for the host; the
learning rate is a tensor on the device that the schedule fills (a float would be baked into the graph);
every batch is copied into a static pair of tensors of its shape (`StaticInputs`), which the graphs read.
A unit's first steps run eagerly (cuDNN and cuBLAS choose their kernels, the optimiser makes its
momentum). A unit has a graph per batch shape, at most SHAPES of them: an epoch's last, smaller batch is
stepped eagerly the first time it comes and replayed from the next epoch on (eager, it cost the paper
ensemble 1.3-2.3 s an epoch, 100 models' kernels launched one by one).

All units of a group capture into one memory pool. That is safe because their graphs replay one at a time
on one stream and keep nothing in the pool from one replay to the next (weights, momentum, inputs and the
losses handed out live outside it), and it keeps a packed group's memory at one member's activations at a
time.
"""
from __future__ import annotations

EAGER_STEPS = 3  # before a unit's first capture: torch's graph examples warm up with three
SHAPES = 2  # batch shapes a stream's graphs take: an epoch's batches, and its last, smaller one


def shape_of(x, y) -> tuple:
    """What a graph's inputs must match: shapes and layout."""
    return tuple(x.shape), tuple(x.stride()), tuple(y.shape)


class StaticInputs:
    """One (x, y) pair per stream and batch shape on the device, the graphs' inputs: each batch of a known
    shape is copied in, and the copy is what every unit of the group trains on (one copy per stream and
    step). A stream's first SHAPES shapes are known."""

    def __init__(self):
        self._pairs: dict[str, dict[tuple, tuple]] = {}  # stream -> shape -> (x, y)

    def take(self, stream: str, x, y) -> tuple[object, object, bool]:
        """(x, y, staged): the static pair holding this batch, staged True; or the batch itself, False,
        when its stream has SHAPES other shapes already."""
        pairs = self._pairs.setdefault(stream, {})
        pair = pairs.get(shape_of(x, y))
        if pair is None:
            if len(pairs) >= SHAPES:
                return x, y, False
            pairs[shape_of(x, y)] = pair = (x.clone(), y.clone())  # clone keeps x's layout (channels_last on GPUs)
            return *pair, True
        static_x, static_y = pair
        static_x.copy_(x)
        static_y.copy_(y)
        return static_x, static_y, True


class StepGraph:
    """A unit's step on static pairs (x, y) of one or more shapes: eager for the unit's first EAGER_STEPS
    and for the first step of each later shape, then captured, a graph per shape, and replayed. `step(x,
    y)` is the unit's eager step (losses on the device); `pool` is shared by the group's graphs; `names`
    (the unit's members) name it in errors."""

    def __init__(self, step, pool, names):
        self._step, self._pool, self._names = step, pool, names
        self._eager_steps = 0
        self._stepped: set[tuple] = set()  # shapes stepped eagerly
        self._graphs: dict[tuple, tuple] = {}  # shape -> (graph, the captured step's losses, rewritten by replays)

    @property
    def captured(self) -> list[tuple]:
        """The shapes captured so far."""
        return list(self._graphs)

    def __call__(self, x, y):
        """One step on a static pair (x, y), the same tensors at every call with their shape."""
        shape = shape_of(x, y)
        if shape not in self._graphs and (self._eager_steps < EAGER_STEPS or shape not in self._stepped):
            self._eager_steps += 1
            self._stepped.add(shape)
            return self._step(x, y)
        if shape not in self._graphs:
            self._graphs[shape] = self._capture(x, y)
        graph, losses = self._graphs[shape]
        graph.replay()
        return losses.clone()  # the next replay rewrites the graph's own

    def _capture(self, x, y) -> tuple:
        import torch

        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                losses = self._step(x, y)  # recorded, not run: the replay that follows runs it
        except RuntimeError as error:  # e.g. a model that reads a value on the host, or changes shape
            raise RuntimeError(f"the training step of {', '.join(self._names)} cannot be captured as a CUDA "
                               f"graph ({error}); set trainer.cuda_graphs=false to train eagerly") from error
        return graph, losses
