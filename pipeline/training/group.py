"""What a trainer trains: a group of models on one slot, stepped on the same batch.

A group of one is a model (data-parallel over its slots when it has several).
A larger group holds one slot: its members are packed (each its own module
and optimiser, stepped in turn, so the peak holds one member's activations)
or, for members of one family (module, sink and loss), fused into arrays:
HFTA's operator fusion for the built-in families it covers
(pipeline/training/fusion.py), vmap for any other family
(pipeline/training/stacked.py). Every member keeps its own
hyper-parameters, schedule, checkpoint and convergence, and can leave the
group alone. Trainers, rate measurement, profile mode and the benchmark all
step groups through `GroupStep`, so what is measured is what trains. With
trainer.compile each unit's forward (and so its backward) is compiled by
torch.compile (inductor) on its first step of each batch shape and mode.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import math
import operator
import time
import warnings
from dataclasses import dataclass, replace

import numpy as np

from pipeline.training.graphs import EAGER_STEPS, StaticInputs, StepGraph, stage
from pipeline.training.members import (ModelSpec, array_fusion, build_loss, build_module, build_optimizer,
                                       build_schedule, canonical, grouped, steps_on_metric, target_of)

# ImageNet statistics: batches arrive as uint8 and are normalised on the device.
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)

MIN_ROWS = 2  # of a batch, each rank trains on at least: batch norm needs two values per channel


def least_batch(world: int) -> int:
    """The smallest batch that gives each of `world` data-parallel ranks its MIN_ROWS rows: a smaller one is
    skipped by every rank alike (as a DataLoader's drop_last remainder), and refused as a configured size."""
    return MIN_ROWS * world


def rank_rows(rank: int, world: int) -> slice:
    """The rows of every batch that data-parallel rank `rank` of `world` trains on: rank, rank + world, ...
    (every rank sees every batch)."""
    return slice(rank, None, world)


def shard_weight(rows: int, world: int, batch_rows: int) -> float:
    """A data-parallel rank's weight on its rows' mean loss (GroupStep.train): its rows over an even share."""
    return rows * world / batch_rows


class Precision(enum.StrEnum):
    """trainer.precision: the dtype of forward and backward (weights and optimiser stay fp32)."""

    fp32 = "fp32"
    bf16 = "bf16"  # autocast to bfloat16
    fp16 = "fp16"  # autocast to float16, with a gradient scaler


@dataclass(frozen=True)
class GroupSpec:
    name: str
    members: tuple[ModelSpec, ...]
    array_size: int = 1  # members of one family fuse into arrays of at most this many (1: packed, none fused)
    cuda_streams: int = 1  # on a GPU, CUDA streams its units step on side by side (1: in turn); auto measures

    def __post_init__(self) -> None:
        if len(self.members) > 1 and any(m.slots > 1 for m in self.members):
            raise ValueError(f"group {self.name}: a data-parallel model trains alone on its slots")

    @property
    def slots(self) -> int:
        return self.members[0].slots

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(sorted({m.input for m in self.members}))

    @property
    def mode(self) -> str:
        """For reports: alone, packed, fused, or fused+packed."""
        if len(self.members) == 1:
            return "alone"
        units = self.units()
        mode = "packed" if all(len(u) == 1 for u in units) else "fused" if len(units) == 1 else "fused+packed"
        return mode + (f" on {self.side_by_side} streams" if self.side_by_side > 1 else "")

    @property
    def side_by_side(self) -> int:
        """The units stepped at once on a GPU: `cuda_streams`, at most one per unit."""
        return min(self.cuda_streams, len(self.units()))

    def describe(self) -> str:
        """What the group trains, for messages: e.g. "a (resnet(depth=10, width=16)), b (densenet(...))"."""
        return ", ".join(f"{m.name} ({m.describe()})" for m in self.members)

    @property
    def largest_family(self) -> int:
        return max(map(len, grouped(self.members, lambda m: m.fuses_with).values()))

    def units(self) -> list[tuple[ModelSpec, ...]]:
        """What steps as one: fused arrays of a family's members, `array_size` at a time, the rest alone.
        Members HFTA takes that share a schedule (an HFTA array steps one) fill arrays of their own first.
        Where the family has members HFTA cannot take, what is left of it is chunked as it comes, so that as
        few arrays as can fuse by vmap, the slower; else each schedule's last members form an HFTA array."""
        size = max(1, self.array_size)
        chunks = lambda members: [tuple(members[i:i + size]) for i in range(0, len(members), size)]
        units = []
        for family in grouped(self.members, lambda m: m.fuses_with).values():
            others = [m for m in family if m.fusion != "hfta"]
            rest = []
            for alike in grouped([m for m in family if m.fusion == "hfta"], lambda m: canonical(m.schedule)).values():
                whole = len(alike) - len(alike) % size if others else len(alike)
                units += chunks(alike[:whole])
                rest += alike[whole:]
            units += chunks(rest + others)
        return units

    def without(self, names: set[str]) -> GroupSpec:
        return replace(self, members=tuple(m for m in self.members if m.name not in names))

    def on_slots(self, slots: int) -> GroupSpec:
        """The group as it trains on `slots` slots, the count the scheduler gave it (a FLEET policy chooses
        its own, whatever the config asked): its trainers' data-parallel world."""
        if len(self.members) > 1 and slots > 1:
            raise ValueError(f"group {self.name}: a group of several models trains on one slot, not {slots}")
        return replace(self, members=tuple(replace(m, slots=slots) for m in self.members))


class StepInHand:
    """Where a training process is, in memory its parent reads while it runs: the step it has begun (of
    which epoch, for a trainer), which members are inside theirs, and whether that step compiles them
    (trainer.compile: it takes as long as compiling does). A child that hangs, in a native kernel or a
    collective, cannot say where it is; its parent can, from this."""

    def __init__(self, context, group: GroupSpec, steps: int):
        self.steps = steps  # of an epoch (a trainer), or of the whole run (a measuring rank)
        self.index = {m.name: i for i, m in enumerate(group.members)}
        self._epoch_step = context.Array("q", [-1, -1], lock=False)  # (epoch, step in it); -1: none
        self._in_step = context.Array("b", len(self.index), lock=False)  # per member: inside its step
        self._compiling = context.Value("b", 0, lock=False)

    def begin(self, step: int, epoch: int = -1) -> None:
        self._epoch_step[:] = [epoch, step]

    @contextlib.contextmanager
    def stepping(self, names):
        """Marks `names` (a unit's members) as inside their step while the block runs."""
        for name in names:
            self._in_step[self.index[name]] = 1
        try:
            yield
        finally:
            for name in names:
                self._in_step[self.index[name]] = 0

    @contextlib.contextmanager
    def compiling(self):
        """Marks the block as a step that compiles."""
        self._compiling.value = 1
        try:
            yield
        finally:
            self._compiling.value = 0

    @property
    def is_compiling(self) -> bool:
        return bool(self._compiling.value)

    def describe(self) -> str:
        """E.g. "at step 5 of 40 of epoch 2, in the step of a, b" (", compiling" added while it does)."""
        epoch, step = self._epoch_step[:]
        if step < 0:
            return "before its first step"
        where = f"at step {step + 1} of {self.steps}" + (f" of epoch {epoch + 1}" if epoch >= 0 else "")
        inside = [name for name, i in self.index.items() if self._in_step[i]]
        where += f", in the step of {', '.join(inside)}" if inside else ", between members' steps"
        return where + (", compiling (trainer.compile)" if self.is_compiling else "")


def training_memory_format(device):
    """The layout a device trains in, chosen here once for every path that trains (trainers, rate
    measurement, profile mode, benchmarks): channels_last on GPUs, cuDNN's fast layout; contiguous (NCHW)
    on CPUs. oneDNN's channels-last convolution backward hangs or corrupts the heap on AVX2-only CPUs at
    small channel counts (a 1x1 stride-2 conv from 2-4 channels to 4-8), and nothing tells which shapes
    are safe; contiguous trains the default ensemble at 0.71-0.83x its speed (docs/benchmarks.md, CPU
    layout; scripts/bench_cpu_layout.py)."""
    import torch

    return torch.channels_last if torch.device(device).type == "cuda" else torch.contiguous_format


def autocast_dtype(precision: Precision):
    """The dtype forward passes autocast to at `precision` (trainer.precision); None for fp32."""
    import torch

    return {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}.get(precision)


def autocast(device, dtype):
    """Where a forward runs at `dtype` (autocast_dtype; None: as it is) on `device`."""
    import torch

    if dtype is None:
        return contextlib.nullcontext()
    # no cast cache: a CUDA graph's capture forbids it, and each weight is cast once a step anyway
    return torch.autocast(torch.device(device).type, dtype=dtype, cache_enabled=False)


def normalise(images, device, memory_format):
    """uint8 NHWC (numpy, or a tensor on the device) -> normalised float NCHW on `device`, in
    `memory_format`: the float batch is the only copy made. What every model of a run is given."""
    import torch

    if isinstance(images, np.ndarray):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # only read
            images = torch.from_numpy(images)
    x = images.to(device, non_blocking=True).permute(0, 3, 1, 2)  # NHWC memory: channels_last
    x = x.to(torch.float32, memory_format=memory_format)
    mean, std = _statistics(x.device)
    return x.sub_(mean).div_(std)


@functools.cache
def _statistics(device):
    """MEAN and STD on `device`, made once (making them is a copy from the host)."""
    import torch

    return (torch.tensor(MEAN, device=device).view(1, 3, 1, 1), torch.tensor(STD, device=device).view(1, 3, 1, 1))


def compile_options(device) -> dict:
    """torch.compile's settings for a unit's forward on `device`: one graph per batch shape (a sink has
    at most two, an epoch's last batch being the other), never a dynamic one. On CPU inductor keeps the
    layout it is given: its own choice, channels-last convolutions, meets oneDNN's channels-last
    convolution backward (see `training_memory_format`), which corrupted the heap in a compiled
    resnet(depth=10, width=8) at 32 px on batches of 3, 5, 7 and 9 images with 2 threads (torch 2.13 on an
    AVX-512 Xeon; with oneDNN held to AVX2 it ran)."""
    import torch

    options = {} if torch.device(device).type == "cuda" else {"layout_optimization": False}
    return {"dynamic": False, "options": options}


def join_process_group(rendezvous: str, rank: int, world: int, device, timeout_s: float, name: str):
    """A data-parallel model's ranks meet: NCCL between GPUs, gloo between CPU slots. Returns what to wrap
    its steps in: a collective not done in `timeout_s` (timeouts.collective_s) fails naming group `name`."""
    from pipeline.delivery.collective import completes, init_process_group

    what = f"group {name}'s data-parallel process group"
    init_process_group(rendezvous, rank, world, str(device), timeout_s, what)
    return functools.partial(completes, f"a DDP collective of {what} (rank {rank} of {world})", timeout_s)


class _OneOptimizer:
    """A unit whose members step under one optimiser and one schedule (`optimizer`, `schedule`)."""

    @property
    def optimizers(self) -> list:
        return [self.optimizer]

    @property
    def schedules(self) -> list:
        return [self.schedule]


class _Solo(_OneOptimizer):
    """One model: its module (DDP when it spans slots), optimiser, schedule and loss, as its member declares."""

    def __init__(self, model: ModelSpec, net, world: int, device, total_steps: int):
        import torch

        self.names, self.input = (model.name,), model.input
        self.module = net
        self.net = net if world == 1 else torch.nn.parallel.DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None)
        graph_safe = graph_safe_arguments(model, device)
        self.capturable = graph_safe is not None
        self.optimizer = build_optimizer(model, net.parameters(), **(graph_safe or {}))
        if self.capturable:
            for group in self.optimizer.param_groups:
                group["lr"] = torch.tensor(float(group["lr"]), device=device)
        self.schedule = build_schedule(model, self.optimizer, total_steps)
        self.loss = _loss_on(model, device)

    def compile(self, options: dict) -> None:
        self.module.compile(**options)  # in place: DDP, its state dict and checkpoints see the same module

    def losses(self, x, y):
        self.net.train()
        return self.loss(self.net(x), y).unsqueeze(0)

    def logits(self, x):
        self.module.eval()
        return self.module(x).unsqueeze(0)

    def member_state(self, index: int) -> dict:
        return _plain_checkpoint(self.module.state_dict(), self.optimizer, self.schedule)

    def kept(self, copy_tensor) -> tuple:
        return _kept_each([self.member_state(0)], copy_tensor)

    def member_rate(self, index: int) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def load_member_state(self, index: int, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        _load_plain_checkpoint(state, self.optimizer, self.schedule)


def graph_safe_arguments(model: ModelSpec, device) -> dict | None:
    """What a member's optimiser is built with on `device` so that its update is device work only, reading its
    rate from a tensor the schedule fills, as a CUDA graph of the step needs (pipeline/training/graphs.py):
    SGD's fused kernel; Adam's and AdamW's, capturable (their step counts kept on the device). None: it steps
    eagerly (a CPU, another optimiser, or one declared with `foreach` or `differentiable`, which fused
    kernels exclude, or declared not fused or not capturable; or a schedule that moves the momentum or betas
    as well as the rate, OneCycleLR's and CyclicLR's cycle_momentum, which the fused kernels take as numbers:
    a graph would replay the momentum of the step it captured)."""
    import torch

    declared, schedule = model.optimizer, model.lr_scheduler
    if (device.type != "cuda" or declared.get("foreach") or declared.get("differentiable")
            or declared.get("fused") is False or declared.get("capturable") is False):
        return None
    if target_of(schedule) in (torch.optim.lr_scheduler.OneCycleLR, torch.optim.lr_scheduler.CyclicLR) \
            and schedule.get("cycle_momentum", True):
        return None
    kind = target_of(model.optimizer)
    if kind is torch.optim.SGD:
        return {"fused": True}
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return {"fused": True, "capturable": True}
    return None


def _kept_each(states: list, copy_tensor) -> tuple:
    """`kept` of a unit whose members' tensors are their own: each member's `states`, copied."""
    return [copied(state, copy_tensor) for state in states], [operator.itemgetter(i) for i in range(len(states))]


def copied(value, copy_tensor):
    """`value` with each tensor in it (in dicts, lists, tuples, a fused array's ArrayStates) `copy_tensor(it)`."""
    import torch

    from pipeline.training.fusion import ArrayStates

    if isinstance(value, torch.Tensor):
        return copy_tensor(value.detach())
    if isinstance(value, ArrayStates):
        return value.copied(lambda t: copy_tensor(t.detach()))
    if isinstance(value, dict):
        return {key: copied(item, copy_tensor) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copied(item, copy_tensor) for item in value)
    return value


def to_host(value):
    """`value` with every tensor copied to host memory (the live ones go on training)."""
    return copied(value, lambda t: t.to("cpu", copy=True))


class KeptStates:
    """Every member's state at one moment (a trainer keeps them at each epoch's end), copied so that the group
    trains on, and each member's checkpoint built from the copy when it is written (`member`).

    On a GPU the copy is a clone there: the trainer's loop queues it and goes on (reading a unit's rates waits
    for the clones queued before, at the device's copy speed), where a copy to host memory held it 5-8 s an
    epoch for the paper ensemble's 8.5 GB (docs/benchmarks.md, the epoch boundary).
    `to_host`, on the checkpoint writer's thread, then moves it to host memory on a CUDA stream of its own
    while the group's next steps run, and frees the clone. On CPU the copy is made in host memory at once."""

    def __init__(self, units: list, device, copy_stream):
        """`copy_stream`: on a GPU the stream `to_host` copies on, one no unit steps on (None on CPU)."""
        import torch

        self.on_device = device.type == "cuda"
        # Clones, where the tensors are (on CPU, host memory). Per unit: its members' names, its copied tensors,
        # and per member a call that builds its state from them.
        self._parts = [(unit.names, *unit.kept(torch.clone)) for unit in units]
        if self.on_device:
            self._cloned = torch.cuda.Event()
            # on the stream the group's steps queue on: after the clones, before the next steps
            self._cloned.record(torch.cuda.current_stream(device))
            self._stream = copy_stream

    @property
    def names(self) -> list[str]:
        return [name for names, _, _ in self._parts for name in names]

    def to_host(self) -> None:
        """The clones copied to host memory once they are made, then freed (nothing to do on CPU)."""
        if not self.on_device:
            return
        import torch

        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._cloned)
            # Each copy to pageable memory returns once done, so the clones, allocated on the group's stream and
            # read on this one, are freed after their last use (a copy that returned at once, non_blocking to
            # pinned memory, would need record_stream first).
            self._parts = [(names, to_host(tensors), builds) for names, tensors, builds in self._parts]
        self.on_device = False

    def member(self, name: str) -> dict:
        """`name`'s checkpoint, built from the host copy."""
        if self.on_device:
            raise RuntimeError(f"{name}'s kept state is still on the GPU: KeptStates.to_host first")
        for names, tensors, builds in self._parts:
            if name in names:
                return builds[names.index(name)](tensors)
        raise KeyError(f"no kept state of {name} (kept: {', '.join(self.names)})")


def _loss_on(m: ModelSpec, device):
    """The member's loss, its tensors (a class weight, say) on `device`."""
    import torch

    loss = build_loss(m)
    return loss.to(device) if isinstance(loss, torch.nn.Module) else loss


def _plain_checkpoint(model: dict, optimizer, schedule) -> dict:
    """A member's checkpoint as a plain module's, optimiser's and schedule's state dicts, whatever device trained
    it (a rate a CUDA graph reads is a tensor there, a float here)."""
    optimizer = optimizer.state_dict()
    for group in optimizer["param_groups"]:
        group.update({key: float(value) for key, value in group.items() if key in ("lr", "initial_lr")})
        for device_setting in ("fused", "capturable"):
            group.pop(device_setting, None)
    schedule = schedule.state_dict()
    for key in ("base_lrs", "_last_lr"):
        if key in schedule:  # (ReduceLROnPlateau keeps no base_lrs)
            schedule[key] = [float(rate) for rate in schedule[key]]
    return {"model": model, "optimizer": optimizer, "lr_scheduler": schedule}


def _load_plain_checkpoint(state: dict, optimizer, schedule) -> None:
    """The optimiser and schedule resume from a `_plain_checkpoint`, loaded with this device's own settings
    (fused, capturable: as it loads, torch moves such an optimiser's step counts onto the device)."""
    settings = [{key: group[key] for key in ("fused", "capturable") if key in group}
                for group in optimizer.param_groups]
    rates = [group["lr"] for group in optimizer.param_groups]
    saved = state["optimizer"]
    optimizer.load_state_dict({**saved, "param_groups": [{**group, **mine} for group, mine
                                                         in zip(saved["param_groups"], settings)]})
    schedule.load_state_dict(state["lr_scheduler"])
    for group, rate in zip(optimizer.param_groups, rates):
        if hasattr(rate, "fill_"):  # the tensor a graph reads, holding the checkpoint's rate
            group["lr"] = rate.fill_(float(group["lr"]))


class _Array(_OneOptimizer):
    """An HFTA fused array of one family's members (ModelSpec.fusion: Nesterov SGD, cosine, cross-entropy)."""

    capturable = True  # FusedSGD's update is device work only, its rate scale a tensor

    def __init__(self, models: tuple[ModelSpec, ...], nets: list, total_steps: int):
        from pipeline.training.fusion import FusedArray

        self.names, self.input = tuple(m.name for m in models), models[0].input
        self.array = FusedArray(nets, [m.optimizer["lr"] for m in models],
                                [m.optimizer.get("momentum", 0.0) for m in models],
                                [m.optimizer.get("weight_decay", 0.0) for m in models])
        self.module = self.net = self.array.module
        self.optimizer = self.array.optimizer
        self.schedule = build_schedule(models[0], self.optimizer, total_steps)  # on the array's rate scale
        self.compiled_with = None  # torch.compile's options, once compiled: a new module is compiled too

    def compile(self, options: dict) -> None:
        self.compiled_with = options
        self.module.compile(**options)

    def losses(self, x, y):
        self.net.train()
        return self.array.losses(self.net(x), y)

    def logits(self, x):
        self.net.eval()
        return self.net(x)

    def member_state(self, index: int) -> dict:
        return _array_member(index, (self.array.states(), self.schedule.state_dict()))

    def kept(self, copy_tensor) -> tuple:
        """The array's tensors copied once each (one copy per fused tensor), each member's state built from
        them when it is wanted."""
        tensors = copied((self.array.states(), self.schedule.state_dict()), copy_tensor)
        return tensors, [functools.partial(_array_member, index) for index in range(len(self.names))]

    def member_rate(self, index: int) -> float:
        (group,) = self.optimizer.param_groups
        return float(group["lr"] * group["lrs"][index])  # the schedule's scale on the member's own

    def load_member_state(self, index: int, state: dict) -> None:
        """Members of an array resume together, after the same steps: its schedule takes theirs."""
        self.array.load_member_state(index, state)
        steps = state["lr_scheduler"]["last_epoch"]
        self.schedule.last_epoch = steps
        for group, base, factor in zip(self.optimizer.param_groups, self.schedule.base_lrs,
                                       (fn(steps) for fn in self.schedule.lr_lambdas)):
            group["lr"].fill_(base * factor)

    def drop(self, index: int) -> None:
        self.array.drop(index)
        self.module = self.net = self.array.module
        self.names = self.names[:index] + self.names[index + 1:]
        if self.compiled_with is not None:
            self.module.compile(**self.compiled_with)


def _array_member(index: int, array: tuple) -> dict:
    """Member `index` of a fused array (its ArrayStates and its schedule's state dict) as a plain model's
    checkpoint, its schedule's state a plain one's (its own rates)."""
    states, schedule = array
    state = states.member(index)
    (group,) = state["optimizer"]["param_groups"]
    rates = {"base_lrs": [group.get("initial_lr", group["lr"])], "_last_lr": [group["lr"]]}
    return {**state, "lr_scheduler": {**schedule, **rates}}


class _Stacked:
    """A vmapped fused array of one family's members (pipeline/training/stacked.py): any module, each member
    with its own optimiser and schedule over its own parameters (views of the array's rows)."""

    capturable = False  # its members' optimisers step views, each as its member declares: not captured yet

    def __init__(self, models: tuple[ModelSpec, ...], nets: list, device, total_steps: int):
        from pipeline.training.stacked import StackedArray

        self.names, self.input = tuple(m.name for m in models), models[0].input
        self.array = StackedArray(nets, _loss_on(models[0], device))  # one family: one loss
        self.optimizers = [build_optimizer(m, net.parameters()) for m, net in zip(models, nets)]
        self.schedules = [build_schedule(m, optimizer, total_steps) for m, optimizer in zip(models, self.optimizers)]

    def compile(self, options: dict) -> None:
        self.array.compile(options)

    def losses(self, x, y):
        return self.array.losses(x, y)

    def logits(self, x):
        return self.array.logits(x)

    def member_state(self, index: int) -> dict:
        state = self._live_state(index)  # clones: a view would keep (and torch.save would write) every member's rows
        return {**state, "model": {name: t.clone() for name, t in state["model"].items()}}

    def _live_state(self, index: int) -> dict:
        """Member `index`'s checkpoint of live tensors, its weights views of the array's rows."""
        return _plain_checkpoint(self.array.nets[index].state_dict(), self.optimizers[index], self.schedules[index])

    def kept(self, copy_tensor) -> tuple:
        return _kept_each([self._live_state(index) for index in range(len(self.names))], copy_tensor)

    def member_rate(self, index: int) -> float:
        return float(self.optimizers[index].param_groups[0]["lr"])

    def load_member_state(self, index: int, state: dict) -> None:
        self.array.nets[index].load_state_dict(state["model"])  # copies into its rows
        _load_plain_checkpoint(state, self.optimizers[index], self.schedules[index])

    def drop(self, index: int) -> None:
        self.array.drop(index)
        del self.optimizers[index], self.schedules[index]
        self.names = self.names[:index] + self.names[index + 1:]


class GroupStep:
    """Trains a group's members on one batch per sink, each on its own sink's batch.

    `total_steps` (the run's) is given to the members' schedules that take it. A data-parallel
    model (a group of one on `world` slots) joins its process group first
    (`init_process_group`, pipeline/delivery/collective.py). Losses stay on the device: a step never waits for it.
    `in_hand`, where given, is told which members are inside their step. With `cuda_graphs`, each unit's
    step and validation forward on a GPU are captured once per batch shape and replayed
    (pipeline/training/graphs.py), except under DDP and fp16 (the gradient scaler reads its overflow check
    on the host). On a GPU with `group.cuda_streams` above 1, the units step on that many CUDA streams side
    by side, launched from this thread (a replayed graph is one launch). With `compile`, each unit's forward
    is compiled (`compile_options`) where it first runs on a batch shape, in training or validation;
    `compile_s` adds up the seconds of those first steps (compiling, a step's own time besides: on a GPU,
    its launches).
    """

    def __init__(self, group: GroupSpec, num_classes: int, image_sizes: dict[str, int], device, total_steps: int, *,
                 precision: Precision = Precision.fp32, world: int = 1, threads: int = 1,
                 memory_format=None, in_hand: StepInHand | None = None, cuda_graphs: bool = False,
                 compile: bool = False):
        import torch

        self.torch, self.group, self.device, self.threads = torch, group, torch.device(device), threads
        self.in_hand = in_hand
        # the layout every path trains in; another only where a benchmark compares them
        self.memory_format = training_memory_format(self.device) if memory_format is None else memory_format
        self.autocast_dtype = autocast_dtype(precision)
        self.units: list[_Solo | _Array | _Stacked] = []
        for unit in group.units():
            nets = [build_module(m, num_classes, image_sizes[m.input]).to(self.device, memory_format=self.memory_format)
                    for m in unit]
            if len(unit) == 1:
                self.units.append(_Solo(unit[0], nets[0], world, self.device, total_steps))
            elif array_fusion(unit) == "hfta":  # the array takes the nets' memory format
                self.units.append(_Array(unit, nets, total_steps))
            else:
                self.units.append(_Stacked(unit, nets, self.device, total_steps))
        for unit in self.units:  # a scaler per unit: a member's overflow skips only its own step
            unit.scaler = torch.amp.GradScaler(self.device.type, enabled=precision == Precision.fp16)
            unit.stream = None  # its index in `streams`, dealt once they are made
        self.compiles, self.compile_s = compile, 0.0
        self.compiled: set[tuple] = set()  # (split, batch shapes) its units have compiled for
        if compile:
            import torch._dynamo

            # Members of one class share their forward's code, and dynamo compiles that code once per
            # architecture, batch shape and mode (train, eval) before it falls back to eager: room for all.
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, 4 * len(group.members))
            for unit in self.units:
                unit.compile(compile_options(self.device))
        # On a GPU, units step on `group.side_by_side` CUDA streams at once, each stream with its own graphs'
        # memory pool (graphs that may run at once must not share one).
        streams = group.side_by_side if self.device.type == "cuda" else 1
        self.streams = [torch.cuda.Stream(self.device) for _ in range(streams)] if streams > 1 else []
        # The kept states' copy to host memory (KeptStates.to_host), from torch's pool of high-priority streams:
        # the units' streams come from the other pool, which hands its 32 out in turn, so a stream taken from it
        # every epoch would in time be a unit's and queue the copy (seconds) behind that unit's steps.
        self.copy_stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self.graphs = cuda_graphs and self.device.type == "cuda" and world == 1 and precision != Precision.fp16
        self.static_inputs = StaticInputs() if self.graphs else None  # the training steps'
        self.val_inputs = StaticInputs() if self.graphs else None  # validation's
        self.graph_pools = [torch.cuda.graph_pool_handle() for _ in range(streams)] if self.graphs else []
        self._deal_streams()
        self.pool = None
        self._plan_lanes()

    @property
    def steps_before_replay(self) -> int:
        """Steps this group takes before its steps are replayed graphs (the eager ones, then the capture):
        a measured pace starts after them. 0 without graphs."""
        return EAGER_STEPS + 1 if self.graphs else 0

    def _deal_streams(self) -> None:
        """Deals the units out to the streams: in turn at the start; as units leave, the fewest moves that keep
        each stream within one unit of the others (a moved unit captures anew: 3 eager steps, a sync). A unit
        given a stream has its graphs made anew, on it."""
        dealt = {index: [u for u in self.units if u.stream == index] for index in range(max(1, len(self.streams)))}
        fewest = lambda: min(dealt, key=lambda index: len(dealt[index]))
        most = lambda: max(dealt, key=lambda index: len(dealt[index]))
        moved = [unit for unit in self.units if unit.stream is None]
        for unit in moved:
            dealt[fewest()].append(unit)
        while len(dealt[most()]) - len(dealt[fewest()]) > 1:
            unit = dealt[most()].pop()
            dealt[fewest()].append(unit)
            moved.append(unit)
        for index, units in dealt.items():
            for unit in units:
                unit.stream = index
        for unit in moved:
            self._new_graph(unit)

    def _new_graph(self, unit) -> None:
        """The unit's step graphs, training's and validation's, to be captured anew, on its stream: at the
        start, and whenever its tensors or its stream change."""
        if not (self.graphs and unit.capturable):
            unit.graph = unit.val_graph = None
            return
        pool, stream = self.graph_pools[unit.stream], self.streams[unit.stream] if self.streams else None
        unit.graph = StepGraph(functools.partial(self._step, unit), pool, unit.names, stream)
        unit.val_graph = StepGraph(functools.partial(self._probabilities, unit), pool, unit.names, stream)

    def _plan_lanes(self) -> None:
        """On CPU, with at least as many units as threads, units step side by side, one thread each:
        measured on 2 cores, small convolutions use a second intra-op thread poorly (a model alone runs
        0.55-0.76x as fast as two one-thread processes), independent units use it fully."""
        import concurrent.futures

        lanes = self.threads if self.device.type == "cpu" and len(self.units) >= self.threads > 1 else 1
        if lanes > 1 and self.pool is None:
            self.torch.set_num_threads(1)
            self.pool = concurrent.futures.ThreadPoolExecutor(lanes, thread_name_prefix="unit")
        elif lanes == 1 and self.pool is not None:  # members left: the rest step in turn, on every thread
            self.pool.shutdown()
            self.pool = None
            self.torch.set_num_threads(self.threads)

    @property
    def names(self) -> list[str]:
        return [name for unit in self.units for name in unit.names]

    def normalise(self, images):
        """`normalise` on the group's device, in its memory format."""
        return normalise(images, self.device, self.memory_format)

    def _autocast(self):
        return autocast(self.device, self.autocast_dtype)

    def train(self, batches: dict[str, tuple], weight: float = 1.0) -> dict[str, object]:
        """One step of every member on its sink's (x, y); each member's loss, a 0-d tensor on the device.
        `weight`: a data-parallel rank's rows over an even share of the batch. DDP averages the ranks'
        gradients, each of its own rows' mean loss: weighted so, every image of an uneven batch (64 on 3
        slots, an epoch's odd last batch) counts as much as it does in one process."""
        with self._compiling("train", batches):
            staged = stage(self.static_inputs, batches)
            stepped = self._each_unit(lambda unit: self._train_unit(unit, *staged[unit.input], weight))
            return {name: loss for names, unit_losses in stepped for name, loss in zip(names, unit_losses)}

    def _each_unit(self, work) -> list:
        """`work(unit)` for every unit, in the units' order: side by side on a CPU slot's threads or a GPU's
        streams, else in turn."""
        if self.pool:
            return list(self.pool.map(work, self.units))
        if not self.streams:
            return [work(unit) for unit in self.units]
        torch = self.torch
        current = torch.cuda.current_stream(self.device)
        # Fork and join: the streams start after all the current stream has queued (the staged inputs, and the
        # last step's readers of their losses), and all that follows waits for every stream. So memory that
        # one stream frees is never reused by another before the first is done with it.
        for stream in self.streams:
            stream.wait_stream(current)
        done = []
        try:
            for unit in self.units:
                with torch.cuda.stream(self.streams[unit.stream]):
                    done.append(work(unit))
        finally:
            for stream in self.streams:
                current.wait_stream(stream)
        return done

    def _compiling(self, split: str, batches: dict[str, tuple]):
        """What a step runs in: a timer into `compile_s` when it is this group's first `split` step on
        these batch shapes, which compiles them; else nothing (every step without trainer.compile)."""
        if not self.compiles:
            return contextlib.nullcontext()
        kind = (split, tuple((sink, tuple(batch[0].shape)) for sink, batch in sorted(batches.items())))
        return contextlib.nullcontext() if kind in self.compiled else self._timed_compile(kind)

    @contextlib.contextmanager
    def _timed_compile(self, kind: tuple):
        started = time.perf_counter()
        with self.in_hand.compiling() if self.in_hand else contextlib.nullcontext():
            yield
        self.compile_s += time.perf_counter() - started
        self.compiled.add(kind)

    def take_compile_s(self) -> float:
        """The seconds its compiling steps took since the last call."""
        taken, self.compile_s = self.compile_s, 0.0
        return taken

    def _train_unit(self, unit, x, y, static: bool, weight: float) -> tuple:
        with self.in_hand.stepping(unit.names) if self.in_hand else contextlib.nullcontext():
            losses = unit.graph(x, y) if static and unit.graph else self._step(unit, x, y, weight)
            for schedule in unit.schedules:
                if not steps_on_metric(schedule):  # (those step once an epoch: `step_schedules`)
                    schedule.step()  # fills the rate tensor a graph reads
        return unit.names, losses

    def _step(self, unit, x, y, weight: float = 1.0):
        """The unit's eager step (what a graph captures, at weight 1: graphs take no DDP); its losses, on the
        device."""
        with self._autocast():  # autocast is per thread: entered where the unit steps
            losses = unit.losses(x, y)
        for optimizer in unit.optimizers:
            optimizer.zero_grad(set_to_none=True)
        total = losses.sum() if weight == 1.0 else losses.sum() * weight  # (at 1, no extra kernel to launch)
        unit.scaler.scale(total).backward()  # members' parameters are disjoint: own gradients
        for optimizer in unit.optimizers:
            unit.scaler.step(optimizer)
        unit.scaler.update()
        return losses.detach().float()

    def predict(self, inputs: dict[str, object]) -> dict[str, object]:
        """Each member's softmax on its sink's x, [N, classes] on the device."""
        batches = {sink: (x,) for sink, x in inputs.items()}
        with self._compiling("validate", batches):
            staged = stage(self.val_inputs, batches)

            def forward(unit):
                x, static = staged[unit.input]
                return unit.names, unit.val_graph(x) if static and unit.val_graph else self._probabilities(unit, x)

            return {name: p for names, unit_probs in self._each_unit(forward) for name, p in zip(names, unit_probs)}

    def _probabilities(self, unit, x):
        """The unit's eager forward (what a validation graph captures): its members' softmax on x."""
        torch = self.torch
        with torch.no_grad(), self._autocast():
            logits = unit.logits(x)
        return torch.softmax(logits.float(), dim=-1)

    def _find(self, name: str) -> tuple[_Solo | _Array | _Stacked, int]:
        for unit in self.units:
            if name in unit.names:
                return unit, unit.names.index(name)
        raise KeyError(f"{name} is not in group {self.group.name} (members: {self.names})")

    def state(self, name: str) -> dict:
        """A member's checkpoint: a plain module's state dict (it loads without the group), and its
        optimiser's and schedule's state dicts, as a plain member's would be."""
        unit, index = self._find(name)
        return unit.member_state(index)

    def kept_states(self) -> KeptStates:
        """Every member's state now, copied, each member's checkpoint (as `state`) built from the copy when it
        is wanted (KeptStates)."""
        return KeptStates(self.units, self.device, self.copy_stream)

    @property
    def stepped_on_validation(self) -> list[str]:
        """The members whose schedule steps on a metric (`steps_on_metric`), which `step_schedules` steps."""
        return [name for name, _ in self._metric_schedules()]

    def step_schedules(self, losses: dict[str, float]) -> None:
        """After an epoch's validation: each `stepped_on_validation` member's schedule, on its validation loss.
        Where that is not a number (no validation images, or a diverged member), its schedule does not step: a
        plateau is judged on losses only."""
        for name, schedule in self._metric_schedules():
            if math.isfinite(losses[name]):
                schedule.step(losses[name])

    def _metric_schedules(self) -> list[tuple[str, object]]:
        """(member, schedule) where the schedule steps on a metric. Only a model alone and a vmap array's members
        have schedules of their own (an HFTA array's one is the cosine)."""
        return [(name, schedule) for unit in self.units if not isinstance(unit, _Array)
                for name, schedule in zip(unit.names, unit.schedules, strict=True) if steps_on_metric(schedule)]

    def rate(self, name: str) -> float:
        """A member's learning rate now (a host sync on a GPU: once an epoch, not a step)."""
        unit, index = self._find(name)
        return unit.member_rate(index)

    def load(self, name: str, state: dict) -> None:
        """Resume a member from `state`; the group's members resume together, after the same steps."""
        unit, index = self._find(name)
        unit.load_member_state(index, state)
        self._new_graph(unit)  # loading replaced the optimiser's tensors the graph would read

    def release(self, name: str) -> None:
        """A member leaves (converged, stopped): its module, optimiser and memory go."""
        unit, index = self._find(name)
        if len(unit.names) == 1:
            self.units.remove(unit)
            self._plan_lanes()
            self._deal_streams()
        else:
            unit.drop(index)  # (a compiled unit compiles anew: its shapes change)
            self._new_graph(unit)  # a new module
            self.compiled.clear()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()  # its memory back to the device, for whoever needs it
