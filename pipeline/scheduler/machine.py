"""The scheduler state machine: events in, decisions out, no I/O.

A driver (the simulator, or the runner of a real run) sends every event to
`Scheduler.handle` and carries out the returned decisions in order.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace

from pipeline.scheduler.events import (AssignSlots, Checkpoint, Decision, EpochFinished, Event, FormFlotilla,
                                       GroupConverged, Join, NodeLost, NodeReturned, PrepCostMeasured, RatesMeasured,
                                       SlotFreed, Start, Stop, TrainerFailed, cause_of)
from pipeline.scheduler.planner import assign_slots
from pipeline.scheduler.policies import Policy
from pipeline.scheduler.cluster import Cluster, PlacementError, RateTable, Slot
from pipeline.scheduler.topology import Topology, choose_topology, split_streams, stream_rate

WAITING, RUNNING, CONVERGED, FAILED = "waiting", "running", "converged", "failed"
TRAIN_LOSS = "train_loss"  # the metric of `EpochFinished` that training phases are read from
FREE, BUSY, RELEASING, LOST = "free", "busy", "releasing", "lost"  # LOST: on a node that is gone


@dataclass
class GroupState:
    status: str = WAITING
    epochs_done: int = 0
    checkpoint_epoch: int = 0  # where the group resumes after a stop or a failure
    failures: int = 0
    flotilla: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # of the last epoch
    loss_drop: float | None = None  # of the training loss in the last epoch, as a fraction of the loss before
    resized: bool = False  # stopped to restart on more slots: it joins no running stream (there: its fewest)


@dataclass
class FlotillaState:
    members: dict[str, tuple[Slot, ...]]
    active: set[str]
    streams: int = 1  # of its topology; a group may join a flotilla of one stream

    @property
    def nodes(self) -> set[int]:
        return {slot.node for slots in self.members.values() for slot in slots}

    @property
    def slots(self) -> int:
        """The slots it runs on: each once, a joiner's taken from a member that left too."""
        return len({slot for slots in self.members.values() for slot in slots})

    @property
    def active_slots(self) -> int:
        return sum(len(self.members[m]) for m in self.active)


class Scheduler:
    """Plans flotillas for `groups` on `cluster` with `policy`.

    Planning starts when every group's rates are in (for the policies that
    need one). A group whose trainers
    fail more than `max_failures` times is given up (status "failed").
    A lost node's slots are out of its plans until the node returns.
    `epochs` and `images_per_epoch`, where given, bound what a group has left
    to train (it may converge sooner): an elastic policy weighs a restart's
    gain on that against the group's start.
    """

    def __init__(self, groups: list[str], cluster: Cluster, policy: Policy, *, seed: int = 0,
                 checkpoint_every: int = 1, max_failures: int = 2, topology: Topology = Topology.auto,
                 broadcast_streams: int = 2, epochs: int | None = None, images_per_epoch: int | None = None):
        if len(set(groups)) != len(groups) or not groups:
            raise ValueError(f"groups must be a non-empty list of distinct names, got {groups}")
        self.cluster, self.policy = cluster, policy
        self.topology, self.broadcast_streams = topology, broadcast_streams  # config: fixed, or auto per flotilla
        self.checkpoint_every, self.max_failures = checkpoint_every, max_failures
        self.epochs, self.images_per_epoch = epochs, images_per_epoch
        self.table = RateTable()
        self.groups = {m: GroupState() for m in groups}
        self.slots = {s: FREE for s in cluster.slots}
        self.lost: set[int] = set()  # nodes gone (NodeLost) and not back
        self.flotillas: dict[int, FlotillaState] = {}
        self.next_flotilla = 0
        self.now = 0.0
        self.rng = random.Random(seed)

    @property
    def done(self) -> bool:
        """Every group converged or was given up, and every slot is free (or lost)."""
        return (all(s.status in (CONVERGED, FAILED) for s in self.groups.values())
                and all(state in (FREE, LOST) for state in self.slots.values()))

    @property
    def stranded(self) -> list[str]:
        """Groups that wait for slots no node left can give: nodes were lost, nothing runs or is being
        released, and the policy planned nothing. The run cannot go on until a lost node returns."""
        if not self.lost or self.flotillas or RELEASING in self.slots.values():
            return []
        return sorted(m for m, s in self.groups.items() if s.status == WAITING)

    def start(self, time: float) -> list[Decision]:
        """The driver is ready: the first plan, for policies that need no
        table (the others plan once the last group's rates have come in)."""
        self.now = max(self.now, time)
        return _caused(self._plan(), f"start at {self.now:.3f} s")

    def checkpointed(self, group: str, epoch: int) -> None:
        """A checkpoint the driver wrote outside the plan (when a run is stopped): `group` resumes from it."""
        state = self._group(group)
        if not state.checkpoint_epoch <= epoch <= state.epochs_done:
            raise ValueError(f"{group}: a checkpoint after {epoch} epochs, but it has done {state.epochs_done} "
                             f"and its last checkpoint is after {state.checkpoint_epoch}")
        state.checkpoint_epoch = epoch

    def state(self) -> dict:
        """Everything the scheduler knows, as JSON: `restore` continues from it (a resumed run)."""
        return {"groups": {name: asdict(state) for name, state in self.groups.items()},
                "flotillas": {str(fid): {"members": {m: [[s.node, s.index] for s in slots]
                                                     for m, slots in f.members.items()},
                                         "active": sorted(f.active)} for fid, f in self.flotillas.items()},
                "slots": {f"{slot.node}/{slot.index}": state for slot, state in self.slots.items()},
                "next_flotilla": self.next_flotilla, "now": self.now, "rng": self.rng.getstate(),
                "rates": {name: list(rates) for name, rates in self.table.rates.items()},
                "starts": self.table.starts,
                "prep_seconds_per_image": self.cluster.prep_seconds_per_image}

    def restore(self, saved: dict) -> list[Decision]:
        """Continue from `state()` of a run that stopped: the flotillas it was running form again, on the
        same slots, their groups resuming from their last checkpoints; then planning goes on as before."""
        if sorted(saved["groups"]) != sorted(self.groups):
            raise ValueError(f"the saved scheduler planned {sorted(saved['groups'])}, this one {sorted(self.groups)}")
        for name, fields in saved["groups"].items():
            self.groups[name] = GroupState(**fields)
        self.flotillas = {int(fid): FlotillaState({m: tuple(Slot(*s) for s in slots)
                                                   for m, slots in f["members"].items()}, set(f["active"]))
                          for fid, f in saved["flotillas"].items()}
        for key, state in saved["slots"].items():  # a slot being released then is free now: its trainer is gone
            self.slots[Slot(*map(int, key.split("/")))] = BUSY if state == BUSY else FREE
        self.next_flotilla, self.now = saved["next_flotilla"], saved["now"]
        version, internal, gauss = saved["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        for name, rates in saved["rates"].items():
            self.table.add(name, tuple(rates), saved["starts"][name])
        self.cluster = replace(self.cluster, prep_seconds_per_image=saved.get("prep_seconds_per_image", 0.0))
        decisions: list[Decision] = []
        for fid, flotilla in sorted(self.flotillas.items()):
            active = {m: slots for m, slots in flotilla.members.items() if m in flotilla.active}  # in plan order
            form = self._form(fid, active)
            flotilla.streams = len(form.streams)
            decisions.append(form)
            decisions += [AssignSlots(fid, m, slots) for m, slots in active.items()]
            for m in active:  # what it did after its last checkpoint is done again
                self.groups[m].epochs_done = self.groups[m].checkpoint_epoch
                decisions.append(Start(fid, m, resume_epoch=self.groups[m].checkpoint_epoch))
        return _caused(decisions + self._plan(), f"resume at {self.now:.3f} s")

    def handle(self, event: Event) -> list[Decision]:
        if event.time < self.now:
            raise ValueError(f"event {event} is older than the scheduler's clock {self.now}; send events in time order")
        self.now = event.time
        if isinstance(event, RatesMeasured):
            decisions = self._rates_measured(event)
        elif isinstance(event, EpochFinished):
            decisions = self._epoch_finished(event)
        elif isinstance(event, GroupConverged):
            decisions = self._converged(event)
        elif isinstance(event, SlotFreed):
            decisions = self._slot_freed(event)
        elif isinstance(event, TrainerFailed):
            decisions = self._failed(event)
        elif isinstance(event, NodeLost):
            decisions = self._node_lost(event)
        elif isinstance(event, NodeReturned):
            decisions = self._node_returned(event)
        elif isinstance(event, PrepCostMeasured):
            self.cluster = replace(self.cluster, prep_seconds_per_image=event.seconds_per_image)
            decisions = []
        else:
            raise TypeError(f"unknown event {event!r}; send one of the events in pipeline.scheduler.events")
        return _caused(decisions + self._plan(), cause_of(event))

    # ------------------------------------------------------------ events

    def _group(self, name: str) -> GroupState:
        if name not in self.groups:
            raise ValueError(f"unknown group {name!r}; the scheduler was built for {sorted(self.groups)}")
        return self.groups[name]

    def _rates_measured(self, event: RatesMeasured) -> list[Decision]:
        self._group(event.group)
        self.table.add(event.group, event.rates, event.start_s)
        self.table.check_fits(self.cluster)
        return []

    def _epoch_finished(self, event: EpochFinished) -> list[Decision]:
        state = self._group(event.group)
        if state.status != RUNNING:  # a late report from trainers already stopped
            return []
        before, loss = state.metrics.get(TRAIN_LOSS), event.metrics.get(TRAIN_LOSS)
        state.epochs_done, state.metrics = event.epoch, dict(event.metrics)
        if before and loss is not None:
            state.loss_drop = (before - loss) / before
        if not (self.checkpoint_every and event.epoch % self.checkpoint_every == 0):
            return []
        state.checkpoint_epoch = event.epoch
        checkpoint = Checkpoint(state.flotilla, event.group, event.epoch)
        restart = self._restart_reason(event.group)
        if restart:
            state.status, state.resized = WAITING, restart == "resized"
            return [checkpoint, *self._leave(event.group, restart)]
        return [checkpoint]

    def _restart_reason(self, group: str) -> str | None:
        """An elastic policy's call, once no group waits: why `group`, just checkpointed, restarts on the
        slot count its phase allows ("resized": more of the idle slots; "plateau": fewer, its loss having
        levelled off while another's on its node still falls), or None."""
        if (not self.policy.elastic or RELEASING in self.slots.values()
                or any(s.status == WAITING for s in self.groups.values())):
            return None
        free = [s for s, state in self.slots.items() if state == FREE]
        running = {m: slots for f in self.flotillas.values() for m, slots in f.members.items() if m in f.active}
        state = self.groups[group]
        slots = self.flotillas[state.flotilla].members[group]
        left = None if self.epochs is None or self.images_per_epoch is None else \
            max(self.epochs - state.epochs_done, 0) * self.images_per_epoch
        return self.policy.resize(group, slots, self._planning_table(), self.cluster, free, running, left)

    def _planning_table(self) -> RateTable:
        """The rate table as the policy plans with it: an elastic policy may hold back the slot counts of
        groups in a late training phase."""
        if not self.policy.elastic:
            return self.table
        return self.policy.by_phase(self.table, {m: s.loss_drop for m, s in self.groups.items()})

    def _converged(self, event: GroupConverged) -> list[Decision]:
        state = self._group(event.group)
        if state.status == WAITING:  # its flotilla stopped first; that checkpoint is final
            state.status = CONVERGED
        if state.status != RUNNING:
            return []
        state.status, state.checkpoint_epoch = CONVERGED, state.epochs_done
        checkpoint = Checkpoint(state.flotilla, event.group, state.epochs_done, final=True)
        return [checkpoint, *self._leave(event.group, event.reason)]

    def _failed(self, event: TrainerFailed) -> list[Decision]:
        state = self._group(event.group)
        if state.status != RUNNING:
            return []
        state.failures += 1
        state.status = FAILED if state.failures > self.max_failures else WAITING
        state.epochs_done = state.checkpoint_epoch
        return self._leave(event.group, "failed")

    def _node_lost(self, event: NodeLost) -> list[Decision]:
        if event.node in self.lost:
            return []
        self.lost.add(event.node)
        decisions: list[Decision] = []
        reason = f"node {event.node} lost"
        for flotilla_id, flotilla in sorted(self.flotillas.items()):
            if event.node not in {s.node for m in flotilla.active for s in flotilla.members[m]}:
                continue
            for group in sorted(flotilla.active):  # its pipeline spans the lost node: every member stops
                state, slots = self.groups[group], flotilla.members[group]
                if any(slot.node == event.node for slot in slots):
                    state.failures += 1
                state.status = FAILED if state.failures > self.max_failures else WAITING
                state.epochs_done, state.flotilla = state.checkpoint_epoch, None
                for slot in slots:
                    self.slots[slot] = RELEASING
                flotilla.active.discard(group)
                decisions.append(Stop(flotilla_id, group, reason, flotilla_ends=not flotilla.active))
            del self.flotillas[flotilla_id]
        for slot in self.slots:
            if slot.node == event.node:
                self.slots[slot] = LOST
        return decisions

    def _node_returned(self, event: NodeReturned) -> list[Decision]:
        if event.node not in self.lost:
            raise ValueError(f"node {event.node} returned but was not lost; send NodeReturned only after NodeLost")
        self.lost.discard(event.node)
        for slot in self.slots:
            if slot.node == event.node:
                self.slots[slot] = FREE
        return []

    def _slot_freed(self, event: SlotFreed) -> list[Decision]:
        if self.slots.get(event.slot) == LOST:  # its node was lost meanwhile: nothing to free
            return []
        if self.slots.get(event.slot) != RELEASING:
            raise ValueError(
                f"slot {event.slot} was freed but is {self.slots.get(event.slot, 'not in the cluster')}; "
                f"send SlotFreed only for slots of a group the scheduler stopped")
        self.slots[event.slot] = FREE
        return []

    # ---------------------------------------------------------- transitions

    def _leave(self, group: str, reason: str) -> list[Decision]:
        """`group` leaves its flotilla; the flotilla stops if too few of its
        slots stay active (sublinear scaling no longer pays for the sharing)."""
        flotilla_id = self.groups[group].flotilla
        flotilla = self.flotillas[flotilla_id]
        flotilla.active.discard(group)
        leaving = [(group, reason)]
        too_few = flotilla.active_slots < self.policy.min_active_fraction * flotilla.slots - 1e-9
        if flotilla.active and too_few:
            leaving += [(m, "flotilla stopped") for m in sorted(flotilla.active)]
        decisions: list[Decision] = []
        for m, why in leaving:
            state = self.groups[m]
            if why == "flotilla stopped":
                state.status, state.checkpoint_epoch = WAITING, state.epochs_done
                decisions.append(Checkpoint(flotilla_id, m, state.epochs_done))
            flotilla.active.discard(m)
            state.flotilla = None
            for slot in flotilla.members[m]:
                self.slots[slot] = RELEASING
            decisions.append(Stop(flotilla_id, m, why, flotilla_ends=not flotilla.active))
        if not flotilla.active:
            del self.flotillas[flotilla_id]
        return decisions

    def _join(self, waiting: list[str], free: list[Slot], table: RateTable) -> list[Decision]:
        """Waiting groups the policy places into running flotillas of one stream on one node, on that
        node's free slots: they join its stream at its next epoch boundary."""
        running = {fid: (min(f.nodes), {m: len(f.members[m]) for m in f.active}) for fid, f in self.flotillas.items()
                   if f.streams == 1 and len(f.nodes) == 1}
        decisions: list[Decision] = []
        for group, fid in self.policy.join(waiting, table, self.cluster, free, running).items():
            count, node = table.slot_counts(group, self.cluster.slots_per_node)[0], running[fid][0]
            flotilla = self.flotillas[fid]
            room = sorted(s for s in free if s.node == node and self.slots[s] == FREE)
            if len(room) < count:
                raise ValueError(f"the policy placed {group} ({count} slots) into flotilla {fid} on node {node}, "
                                 f"which has {len(room)} free; a policy's join must fit the free slots")
            slots, state = tuple(room[:count]), self.groups[group]
            flotilla.members[group] = slots
            flotilla.active.add(group)
            state.status, state.flotilla = RUNNING, fid
            for slot in slots:
                self.slots[slot] = BUSY
            decisions += [AssignSlots(fid, group, slots), Join(fid, group, resume_epoch=state.checkpoint_epoch)]
        return decisions

    def _form(self, flotilla_id: int, members: dict[str, tuple[Slot, ...]]) -> FormFlotilla:
        """The decision that forms a flotilla of `members` (group -> its slots, in plan order): its
        topology and streams chosen from the cluster model, its planned rate (its slowest stream's) and
        start (its slowest member's)."""
        nodes = {m: tuple(slot.node for slot in slots) for m, slots in members.items()}
        topology, why = choose_topology(nodes, self.table, self.cluster, self.topology)
        measured = all(m in self.table.rates for m in members)
        rates = {m: self.table.rate(m, len(slots)) for m, slots in members.items()} if measured else {}
        streams = split_streams(topology, list(members), rates, self.broadcast_streams)
        rate = min(stream_rate(stream, nodes, topology, self.table, self.cluster)
                   for stream in streams) if measured else float("nan")
        return FormFlotilla(flotilla_id, {m: len(slots) for m, slots in members.items()}, rate, topology,
                            streams, why, max(self.table.start(m) for m in members))

    def _plan(self) -> list[Decision]:
        """Form flotillas on the free slots when the policy wants them: never
        while slots are being released (they come back together), and for
        FLEET-G and homogeneous only once the cluster is idle."""
        waiting = [m for m, s in self.groups.items() if s.status == WAITING]
        free = [s for s, state in self.slots.items() if state == FREE]
        measured = len(self.table.rates) == len(self.groups)
        if (not waiting or not free or (self.policy.needs_rates and not measured)
                or RELEASING in self.slots.values()
                or (self.policy.waits_for_idle_cluster and self.flotillas)):
            return []
        table = self._planning_table()
        joining = [m for m in waiting if not self.groups[m].resized]
        decisions = self._join(joining, free, table) if self.policy.join_running and joining else []
        if decisions:
            waiting = [m for m in waiting if self.groups[m].status == WAITING]
            free = [s for s, state in self.slots.items() if state == FREE]
            if not waiting or not free:
                return decisions
        try:
            planned = self.policy.form(waiting, table, self.cluster, free, self.rng)
        except PlacementError:
            if not self.lost:
                raise
            planned = []  # what the lost nodes' slots would take: the groups wait (`stranded`)
        placement = assign_slots({m: g for members in planned for m, g in members.items()}, free)
        for members in planned:
            flotilla_id, self.next_flotilla = self.next_flotilla, self.next_flotilla + 1
            form = self._form(flotilla_id, {m: placement[m] for m in members})
            self.flotillas[flotilla_id] = FlotillaState({m: placement[m] for m in members}, set(members),
                                                        len(form.streams))
            decisions.append(form)
            decisions += [AssignSlots(flotilla_id, m, placement[m]) for m in members]
            for m in members:
                state = self.groups[m]
                state.status, state.flotilla, state.resized = RUNNING, flotilla_id, False
                for slot in placement[m]:
                    self.slots[slot] = BUSY
                decisions.append(Start(flotilla_id, m, resume_epoch=state.checkpoint_epoch))
        if not self.flotillas and not self.lost:
            raise RuntimeError(
                f"no flotilla can start: waiting groups {waiting} do not fit the free slots "
                f"{sorted(map(str, free))}; check the rate table against the cluster's slots per node")
        return decisions


def _caused(decisions: list[Decision], cause: str) -> list[Decision]:
    return [replace(decision, cause=cause) for decision in decisions]
