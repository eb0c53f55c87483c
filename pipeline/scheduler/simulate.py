"""Event-driven simulator: drives the real `Scheduler` from a rate table and
per-model convergence epochs, with a CPU model, and draws Gantt charts.

Execution model (the exact solver in `exact.py` uses the same one for flotillas
of one stream, without joins):
* a flotilla's members consume its streams (`FormFlotilla.streams`, one but
  for multi_broadcast and duplicated), each in lockstep at its rate: its
  slowest active member's measured rate, capped by the preprocessing and the
  network its topology gives it (`topology.stream_rate`);
* a stream flows once its members have started: the longest start
  (`RateTable.start`: compiling, graph capture) of its members after the
  flotilla forms, their slots held meanwhile;
* a model converges at the end of its `epochs[model]`-th epoch, or, with a
  `time_limit_seconds` (the FLEET paper's 240 minutes per model), at the end
  of the epoch in which its training time reaches the limit;
* a stopped model's slots come back `checkpoint_seconds` later; a model
  that joins a running stream (`Join`) holds its slots at once and reads
  from the stream's next epoch boundary on; the stream does not pause (its
  trainers start during the epoch and attach to the running hub: the
  instances have one input, so a joiner always reads what the hub makes);
* each epoch reports the model's training loss from `Instance.losses` (see
  `loss_curve`), which elastic policies read training phases from.
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field

from pipeline.scheduler.events import (Decision, EpochFinished, FormFlotilla, GroupConverged, Join,
                                       RatesMeasured, SlotFreed, Start, Stop)
from pipeline.scheduler.gantt import Bar, Gantt, utilisation
from pipeline.scheduler.machine import TRAIN_LOSS, Scheduler
from pipeline.scheduler.planner import work_bound
from pipeline.scheduler.policies import Policy
from pipeline.scheduler.cluster import Cluster, RateTable, Slot
from pipeline.scheduler.topology import Topology, stream_rate


@dataclass
class Instance:
    """An ensemble to train: rate table, epochs until each model converges, and the cluster."""

    table: RateTable
    epochs: dict[str, int]
    cluster: Cluster
    images_per_epoch: int
    checkpoint_seconds: float = 0.0
    time_limit_seconds: float | None = None  # a model stops once it has trained this long, converged or not
    losses: dict[str, tuple[float, ...]] = field(default_factory=dict)  # training loss after epoch 1, 2, ...


@dataclass
class SimResult:
    end_time: float  # seconds until every model converged and its slots were freed
    utilisation: float  # busy slot-seconds / (slots * end_time)
    decision_seconds: float  # wall-clock time spent inside Scheduler.handle
    bars: list[Bar]
    flotillas: int


@dataclass
class _Stream:
    """One stream of a flotilla: its members read it in lockstep."""

    topology: Topology
    members: dict[str, tuple[Slot, ...]] = field(default_factory=dict)
    joining: dict[str, tuple[Slot, ...]] = field(default_factory=dict)  # from its next epoch boundary
    progress: float = 0.0  # images of the current epoch already consumed
    rate: float = 0.0
    since: float = 0.0  # when progress was last brought up to date, or (later than now) when it starts to flow
    version: int = 0  # bumps on every rate change; older epoch-end events are stale


class _Simulation:
    def __init__(self, instance: Instance, policy: Policy, seed: int):
        self.instance = instance
        # It knows what a real run's does: the most epochs a model trains (not when each converges)
        self.scheduler = Scheduler(list(instance.epochs), instance.cluster, policy, seed=seed,
                                   epochs=max(instance.epochs.values()), images_per_epoch=instance.images_per_epoch)
        self.streams: dict[tuple[int, int], _Stream] = {}  # (flotilla, index) -> stream
        self.stream_of: dict[str, tuple[int, int]] = {}
        self.epochs_done: dict[str, int] = {}
        self.trained_s: dict[str, float] = {}  # time in flotillas before the current one
        self.gantt = Gantt()
        self.queue: list[tuple[float, int, str, object]] = []
        self.sequence = 0
        self.decision_seconds = 0.0
        self.now = 0.0

    def run(self) -> SimResult:
        for model, rates in self.instance.table.rates.items():
            self.send(RatesMeasured(0.0, model, rates, self.instance.table.start(model)))
        while self.queue:
            self.now, _, kind, payload = heapq.heappop(self.queue)
            if kind == "free":
                self.send(SlotFreed(self.now, payload))
            elif kind == "epoch":
                self.end_epoch(*payload)
        if not self.scheduler.done:
            raise RuntimeError("simulation ran out of events before every model converged")
        bars = self.gantt.bars  # every model stopped
        return SimResult(self.now, utilisation(bars, self.instance.cluster.total_slots, self.now),
                         self.decision_seconds, bars, self.scheduler.next_flotilla)

    def send(self, event) -> None:
        started = time.perf_counter()
        decisions = self.scheduler.handle(event)
        self.decision_seconds += time.perf_counter() - started
        changed = set()
        for decision in decisions:
            changed.add(self.apply(decision))
            self.gantt.saw(decision, self.now)
        for key in changed - {None}:
            self.reschedule(key)

    def apply(self, decision: Decision) -> tuple[int, int] | None:
        """Carry out one decision; return the stream whose rate may change."""
        if isinstance(decision, FormFlotilla):
            for index, names in enumerate(decision.streams):
                starts = max(self.instance.table.start(name) for name in names)
                self.streams[decision.flotilla, index] = _Stream(decision.topology, since=self.now + starts)
                self.stream_of.update({name: (decision.flotilla, index) for name in names})
        elif isinstance(decision, Start):
            self.streams[self.stream_of[decision.group]].members[decision.group] = self.gantt.assigned[decision.group]
            self.epochs_done[decision.group] = decision.resume_epoch
            return self.stream_of[decision.group]
        elif isinstance(decision, Join):  # its slots are held from now on, its training starts at the boundary
            key = self.stream_of[decision.group] = (decision.flotilla, 0)
            self.streams[key].joining[decision.group] = self.gantt.assigned[decision.group]
            self.epochs_done[decision.group] = decision.resume_epoch
        elif isinstance(decision, Stop):
            key = self.stream_of[decision.group]
            stream = self.streams[key]
            self.settle(stream)
            members = stream.members if decision.group in stream.members else stream.joining
            slots = members.pop(decision.group)
            since = self.gantt.running[decision.group][1]
            self.trained_s[decision.group] = self.trained_s.get(decision.group, 0.0) + self.now - since
            for slot in slots:
                self.push(self.now + self.instance.checkpoint_seconds, "free", slot)
            if not stream.members and stream.joining:  # nobody reads on: the joiners start a new epoch now
                stream.members, stream.joining, stream.progress = stream.joining, {}, 0.0
            if not stream.members:
                del self.streams[key]
                return None
            return key
        return None  # Checkpoint: its cost is modelled by the delay before slots come back

    def settle(self, stream: _Stream) -> None:
        stream.progress += stream.rate * max(0.0, self.now - stream.since)
        stream.since = max(stream.since, self.now)

    def reschedule(self, key: tuple[int, int]) -> None:
        stream = self.streams.get(key)
        if stream is None:
            return
        self.settle(stream)
        nodes = {m: tuple(slot.node for slot in slots) for m, slots in stream.members.items()}
        stream.rate = stream_rate(tuple(stream.members), nodes, stream.topology, self.instance.table,
                                  self.instance.cluster)
        stream.version += 1
        left = max(self.instance.images_per_epoch - stream.progress, 0.0)
        self.push(stream.since + left / stream.rate, "epoch", (key, stream.version))

    def end_epoch(self, key: tuple[int, int], version: int) -> None:
        stream = self.streams.get(key)
        if stream is None or stream.version != version:
            return
        stream.progress, stream.since = 0.0, self.now
        members = list(stream.members)
        if stream.joining:  # they read from the next epoch on, their trainers started meanwhile
            stream.members.update(stream.joining)
            stream.joining = {}
        for model in members:
            self.epochs_done[model] += 1
            epoch, target = self.epochs_done[model], self.instance.epochs[model]
            metrics = {"val_accuracy": min(epoch / target, 1.0)}
            curve = self.instance.losses.get(model)
            if curve:
                metrics[TRAIN_LOSS] = curve[min(epoch, len(curve)) - 1]
            self.send(EpochFinished(self.now, model, epoch, metrics))
        limit = self.instance.time_limit_seconds
        for model in members:
            running = self.gantt.running.get(model)  # (absent when its flotilla stopped it just now)
            trained = self.trained_s.get(model, 0.0) + (self.now - running[1] if running else 0.0)
            if self.epochs_done[model] >= self.instance.epochs[model] or (limit and trained >= limit):
                self.send(GroupConverged(self.now, model))
        if self.streams.get(key) is stream:
            self.reschedule(key)

    def push(self, at: float, kind: str, payload: object) -> None:
        self.sequence += 1
        heapq.heappush(self.queue, (at, self.sequence, kind, payload))


def simulate(instance: Instance, policy: Policy, seed: int = 0) -> SimResult:
    """Train `instance` to convergence under `policy`; `seed` drives the random baselines."""
    return _Simulation(instance, policy, seed).run()


def lower_bound(instance: Instance, epochs: dict[str, int] | None = None) -> float:
    """End-to-end time no schedule can beat for the `epochs` left of each model (default: all of
    them; `planner.work_bound`, whatever runs at once), plus the checkpoint that ends training, if any
    is left. With a time limit a model's work depends on the schedule: no bound is given."""
    if instance.time_limit_seconds is not None:
        raise ValueError("a time-limited model's work depends on its schedule; give an instance without "
                         "time_limit_seconds for a lower bound")
    epochs = instance.epochs if epochs is None else epochs
    if not any(epochs.values()):
        return 0.0
    work = {m: e * instance.images_per_epoch for m, e in epochs.items()}
    return work_bound(work, instance.table, instance.cluster) + instance.checkpoint_seconds


def random_instance(rng: random.Random, models: int, cluster: Cluster,
                    single_slot_rates: tuple[float, float] = (21.0, 176.0), epochs: tuple[int, int] = (10, 60),
                    images_per_epoch: int = 30_000, checkpoint_seconds: float = 0.0,
                    time_limit_seconds: float | None = None) -> Instance:
    """Random heterogeneous ensemble: single-slot rates uniform in
    `single_slot_rates`, sublinear data-parallel scaling
    rate(g) = rate(1) * g / (1 + s * (g - 1)) with s uniform in [0.05, 0.35],
    convergence epochs uniform in `epochs`; no model trains past `time_limit_seconds`."""
    table, converge = RateTable(), {}
    for i in range(models):
        name = f"dnn{i + 1:03d}" if models > 9 else f"dnn{i + 1}"
        rate, slowdown = rng.uniform(*single_slot_rates), rng.uniform(0.05, 0.35)
        table.add(name, [rate * g / (1 + slowdown * (g - 1)) for g in range(1, cluster.slots_per_node + 1)])
        converge[name] = rng.randint(*epochs)
    losses = {name: loss_curve(epochs) for name, epochs in converge.items()}
    return Instance(table, converge, cluster, images_per_epoch, checkpoint_seconds, time_limit_seconds, losses)


def loss_curve(epochs: int, start: float = 5.5, floor: float = 0.5, last_drop: float = 0.01) -> tuple[float, ...]:
    """Training loss after each of `epochs` epochs, for a model that converges then: it decays
    geometrically from `start` (ln 256 ~ 5.5, chance on 256 classes) towards `floor`,
    loss(e) = floor + (start - floor) d^e, with the factor d that makes the last epoch's drop
    `last_drop` of the loss before it (the loss has levelled off near `floor`; with too few epochs to get
    there, the steepest decay whose last drop still is `last_drop`). So every model levels off in the same way
    just before it converges, whatever its epoch count: a threshold on the drop per epoch marks the
    same late phase of each."""
    scale = start - floor

    def drop(d: float) -> float:
        before = floor + scale * d ** (epochs - 1)
        return scale * d ** (epochs - 1) * (1 - d) / before

    # The drop rises then falls in d (at d near 1 the loss has hardly moved); the root below the peak
    # is the curve that has levelled off near `floor`.
    low, high = 0.0, max((i / 1000 for i in range(1, 1000)), key=drop)
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if drop(middle) > last_drop else (middle, high)
    d = (low + high) / 2
    return tuple(floor + scale * d ** e for e in range(1, epochs + 1))
