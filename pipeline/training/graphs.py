"""A unit's training step as a CUDA graph: captured once, then replayed as one launch.

On a GPU a small model's eager step is bound by kernel launches: at 64 px one ResNet-18 keeps an H100
busy a quarter of the time, and a packed slot, stepping its members in turn from one thread, trains at
one model's speed whatever its size (docs/benchmarks.md, slot groups). A replayed graph runs the step's
hundreds of kernels back to back, without Python or the driver between them.

Whole-step capture follows torch's rules (torch.cuda.graphs): nothing in the step waits for the host; the
learning rate is a tensor on the device that the schedule fills (a float would be baked into the graph);
every batch is copied into one static pair of tensors per stream (`StaticInputs`), which the graphs read.
A unit's first steps run eagerly (cuDNN and cuBLAS choose their kernels, the optimiser makes its
momentum), and so does every batch of another shape than the static one (an epoch's last).

All units of a group capture into one memory pool. That is safe because they replay one at a time on one
stream and keep nothing in the pool from one replay to the next (weights, momentum, inputs and the losses
handed out live outside it), and it keeps a packed group's memory at one member's activations at a time.
"""
from __future__ import annotations

EAGER_STEPS = 3  # before the capture: torch's graph examples warm up with three


class StaticInputs:
    """One (x, y) pair per stream on the device, the graphs' inputs: each batch of their shape is copied
    in, and the copy is what every unit of the group trains on (one copy per stream and step)."""

    def __init__(self):
        self._pairs: dict[str, tuple] = {}

    def take(self, stream: str, x, y) -> tuple[object, object, bool]:
        """(x, y, staged): the static pair holding this batch, staged True; or the batch itself, False,
        when its shape is not the static one. The first batch of a stream fixes its shape."""
        pair = self._pairs.get(stream)
        if pair is None:  # clone keeps x's layout (channels_last on GPUs)
            self._pairs[stream] = pair = (x.clone(), y.clone())
            return *pair, True
        static_x, static_y = pair
        if x.shape != static_x.shape or x.stride() != static_x.stride() or y.shape != static_y.shape:
            return x, y, False
        static_x.copy_(x)
        static_y.copy_(y)
        return static_x, static_y, True


class StepGraph:
    """A unit's step on its stream's static pair: eager for the first EAGER_STEPS, then captured and
    replayed. `step(x, y)` is the unit's eager step (losses on the device); `pool` is shared by the
    group's graphs; `names` (the unit's members) name it in errors."""

    def __init__(self, step, pool, names):
        self._step, self._pool, self._names = step, pool, names
        self._eager_steps = 0
        self._graph = None
        self._losses = None  # the captured step's output, rewritten by each replay

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self, x, y):
        """One step on the static pair (x, y), the same tensors at every call."""
        import torch

        if self._graph is None and self._eager_steps < EAGER_STEPS:
            self._eager_steps += 1
            return self._step(x, y)
        if self._graph is None:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    self._losses = self._step(x, y)  # recorded, not run: the replay below runs it
            except RuntimeError as error:  # e.g. a model that reads a value on the host, or changes shape
                raise RuntimeError(f"the training step of {', '.join(self._names)} cannot be captured as a CUDA "
                                   f"graph ({error}); set trainer.cuda_graphs=false to train eagerly") from error
            self._graph = graph
        self._graph.replay()
        return self._losses.clone()  # the next replay rewrites the graph's own
