"""Carries out the scheduler's decisions on real trainers.

The scheduler (pipeline/scheduler) decides and does no I/O; this driver acts.
Each flotilla it forms gets a thread that feeds the flotilla's trainers from
the shared pipeline on Dask. After each epoch the thread hands its members'
validation results to the main thread and waits; the main thread turns them
into scheduler events (epoch finished, converged, failed), carries out the
decisions (checkpoint, stop a member, form the next flotilla) and lets the
thread go on.

After every event the main thread saves the scheduler's and the recorder's
state (`state_dir`); a stopped or crashed run continues from it and from the
checkpoints (`resume=`). A stop request (Ctrl-C, SIGTERM: StopSignals) ends
every flotilla in order: each checkpoints its models' last finished epoch and
closes its processes within timeouts.stop_s.
"""
from __future__ import annotations

import json
import math
import queue
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from pipeline.data.graph import StageGraph
from pipeline.delivery.messages import SplitDone
from pipeline.delivery.plan import plan_delivery
from pipeline.runtime.hang import HangError
from pipeline.measure.recorder import RunRecorder, write_json
from pipeline.measure.tracking import Tracker
from pipeline.scheduler.halving import Halving
from pipeline.orchestration.flotilla import DeliverySetup, Flotilla, Member
from pipeline.orchestration.agent import HostLost, NodeAgents
from pipeline.runtime.lifetime import StopSignals
from pipeline.orchestration.watch import SplitWatch
from pipeline.scheduler import (AssignSlots, Checkpoint, EpochFinished, FormFlotilla, GroupConverged, Join, NodeLost,
                                NodeReturned, PrepCostMeasured, Scheduler, SlotFreed, Start, Stop, TrainerFailed)
from pipeline.scheduler.cluster import Slot
from pipeline.scheduler.gantt import Bar, Gantt
from pipeline.scheduler.machine import FAILED, TRAIN_LOSS
from pipeline.training.reports import CheckpointSaved, ResumedEarlier, TrainerDone, TrainerReport, ValReport
from pipeline.training.group import GroupSpec
from pipeline.training.trainer import TrainingSetup
from stages.base import Split



@dataclass(frozen=True)
class Convergence:
    """When a model is done: any criterion met ends its training; with successive halving, the rungs
    that cull the weaker members too."""

    max_epochs: int  # trainer.epochs
    target_accuracy: float | None  # validation accuracy that is good enough
    patience: int  # epochs without improving the best by min_delta (0: off)
    min_delta: float
    halving: Halving | None = None  # scheduler.halving

    def reason(self, accuracies: list[float]) -> str | None:
        if len(accuracies) >= self.max_epochs:
            return f"reached trainer.epochs={self.max_epochs}"
        if self.target_accuracy is not None and accuracies[-1] >= self.target_accuracy:
            return f"reached target accuracy {self.target_accuracy:.1%}"
        if self.patience and len(accuracies) > self.patience:
            before = max(accuracies[:-self.patience])
            # (rounded: one image of 200 is 0.005, and 0.815 - 0.81 < 0.005 in floating point)
            if round(max(accuracies[-self.patience:]) - before, 9) < self.min_delta:
                return f"no gain of {self.min_delta:.1%} in {self.patience} epochs"
        return None


@dataclass(frozen=True, kw_only=True)  # many fields, two adjacent timeouts: called by name
class RunContext:
    """What the flotilla threads share."""

    graph: StageGraph
    setup: TrainingSetup
    delivery: DeliverySetup
    recorder: RunRecorder
    tracker: Tracker  # the main thread's: each member's epochs, written as they end
    progress: Progress
    report_s: float  # timeouts.report_s: a trainer silent this long when it owes a report is hung
    stop_s: float  # timeouts.stop_s: from a stop request to every process gone
    state_dir: Path  # where the run keeps what `resume=` continues from


# Flotilla thread -> driver (the main thread): what happened.
@dataclass(frozen=True)
class EpochDone:
    """Every member's validation of one epoch (members that failed meanwhile are left out), then the
    groups that failed in the same round: the main thread takes both in this order before the thread
    goes on, so no survivor trains an epoch the scheduler has already stopped it from."""

    thread: FlotillaThread
    reports: list[ValReport]
    failed: list[tuple[str, str]]  # (group, why)


@dataclass(frozen=True)
class MemberLeft:
    """A member (a group) stopped on the driver's command: its slots are free."""

    thread: FlotillaThread
    group: str


@dataclass(frozen=True)
class HostGone:
    """A node the flotilla spans was lost: the thread closed what it could reach of the flotilla."""

    thread: FlotillaThread
    lost: HostLost


@dataclass(frozen=True)
class ThreadFailed:
    thread: FlotillaThread
    error: BaseException


@dataclass(frozen=True)
class ThreadEnded:
    """The flotilla is closed. `saved`: group -> epochs of the checkpoints it wrote as the run stopped."""

    thread: FlotillaThread
    saved: dict[str, int]


ThreadEvent = EpochDone | MemberLeft | HostGone | ThreadFailed | ThreadEnded


# Driver -> flotilla thread, after each epoch: checkpoints to write, groups to stop, models to release
# from their groups, then go on.
@dataclass(frozen=True)
class SaveCheckpoints:
    """Write the checkpoints of `models` (those of them still in `group`) after `epochs` epochs."""

    group: str
    models: tuple[str, ...]
    epochs: int


@dataclass(frozen=True)
class StopMember:
    group: str


@dataclass(frozen=True)
class ReleaseModel:
    """`model` has converged; the rest of its group trains on."""

    group: str
    model: str


@dataclass(frozen=True)
class JoinMember:
    """`member` joins the flotilla's stream: sent as the scheduler decides it (not at a boundary), so that
    its trainers start during the epoch and read from the next one on."""

    member: Member


@dataclass(frozen=True)
class Continue:
    pass


class Stopping(Exception):
    """The run is stopping: a flotilla thread leaves its epochs."""


EVENT_POLL_S = 0.2  # how often the main thread, waiting for an event, looks for a stop request
RETURN_POLL_S = 2.0  # how often it looks for an agent started again for a lost node
STOP_SAVE_SHARE = 0.5  # of timeouts.stop_s, what checkpointing the last epochs may take; closing gets the rest


class FlotillaThread(threading.Thread):
    """Runs one flotilla: its epochs, split by split, until no member is left or the run stops. Between
    two epochs its EpochBoundary carries out what the main thread commanded."""

    def __init__(self, formed: FormFlotilla, members: list[Member], run: RunContext, events: queue.Queue,
                 first_epoch: int = 0):
        super().__init__(name=f"flotilla-{formed.flotilla}", daemon=True)
        self.flotilla_id, self.formed, self.members = formed.flotilla, formed, members
        self.run_ctx, self.events = run, events
        self.first_epoch = first_epoch  # of its sequence: > 0 for a flotilla formed again (a resumed run)
        # The main thread's words: read at the epoch boundary, and joiners taken in during the epoch.
        self.commands: queue.Queue[SaveCheckpoints | StopMember | ReleaseModel | Continue] = queue.Queue()
        self.joins: queue.Queue[JoinMember] = queue.Queue()  # models that join the stream, as they come
        self.stop_requested = threading.Event()
        self.stop_by = 0.0  # time.monotonic() by which a stop must be done
        self.boundary = EpochBoundary(self)

    def stop(self, by: float) -> None:
        """Leave the epochs: checkpoint the last finished ones, close, all by time.monotonic() `by`."""
        self.stop_by = by
        self.stop_requested.set()
        self.commands.put(Continue())  # it may be waiting for the main thread

    @property
    def nodes(self) -> set[int]:
        return {node for member in self.members for node in member.nodes}

    def check_stop(self) -> None:
        if self.stop_requested.is_set():
            raise Stopping

    def run(self) -> None:
        try:
            self._train()
        except HostLost as lost:
            self.events.put(HostGone(self, lost))
        except BaseException as err:  # handed to the main thread, which stops the run
            self.events.put(ThreadFailed(self, err))
        finally:
            self.events.put(ThreadEnded(self, self.boundary.saved_on_stop))

    def _train(self) -> None:
        r, boundary = self.run_ctx, self.boundary
        epoch = self.first_epoch  # of this flotilla's sequence: its shuffles are its own (HubSpec.sequence)
        streams = self.formed.streams
        while self.members:  # one layout per membership: models joining at a boundary lay it out again
            graph = r.graph.feeding({sink for member in self.members for sink in member.group.inputs})
            # The scheduler chose the topology and the streams; the hubs go where the trainers are.
            plan = plan_delivery(self.formed.topology, {m.group.name: m.nodes for m in self.members}, streams)
            why = self.formed.why
            r.progress.console.print(f"flotilla {self.flotilla_id}: {plan.topology}, {len(plan.streams)} "
                                     f"stream(s), {len(plan.hubs)} hub(s) ({why})")
            r.recorder.delivery_plan(self.flotilla_id, plan, why)
            with Flotilla(self.flotilla_id, self.members, graph, plan, r.setup, r.delivery) as flotilla:
                try:
                    while flotilla.members and not boundary.joining:
                        self.check_stop()
                        # A trainer may report its validation before the driver hears that the hubs are done,
                        # and then die: its failure is told after the epoch it finished (it resumes from there).
                        early, failed = [], []
                        for split in (Split.TRAIN, Split.VAL):
                            reports, failures = self._deliver(flotilla, graph, split, epoch)
                            early += reports
                            failed += failures
                        reports, failures = self._validation_reports(flotilla, early)
                        boundary.reported.update({report.model: report.epoch + 1 for report in reports})
                        self.events.put(EpochDone(self, reports, failed + failures))
                        epoch += 1
                        boundary.apply(flotilla, epoch)
                    self.members = boundary.lay_out_again(flotilla, epoch) if boundary.joining else []
                except Stopping:
                    boundary.save_on_stop(flotilla)
                    flotilla.close(within=max(self.stop_by - time.monotonic(), 1.0))
                    return
            streams = (tuple(m.group.name for m in self.members),)  # a flotilla that takes joiners has one

    def _deliver(self, flotilla: Flotilla, graph: StageGraph, split: Split, epoch: int
                 ) -> tuple[list[ValReport], list[tuple[str, str]]]:
        """The hubs deliver one split's epoch; meanwhile trainers' reports are recorded and failed
        members leave. Returns the validation reports that came in, and the failures."""
        validation, failures = [], []
        r = self.run_ctx
        leads = {stream.hubs[0]: 0 for stream in flotilla.plan.streams}  # batches each stream has delivered
        task = r.progress.add_task(f"flotilla {self.flotilla_id} epoch {epoch + 1} {split.value}",
                                   total=graph.source.num_batches(split))
        done: set[int] = set()
        tasks: set[tuple] = set()  # batch tasks recorded: (index, worker, start)
        flotilla.run_split(split, epoch)
        watch = SplitWatch(flotilla, r.delivery.patience, r.progress.console.print)  # never hang silently
        try:
            while len(done) < len(flotilla.plan.hubs) and flotilla.members:
                self.check_stop()
                self.boundary.take_in(flotilla)
                for event in flotilla.hub_progress(timeout=0.2):
                    watch.saw(event)
                    if isinstance(event, SplitDone):
                        done.add(event.hub)
                        r.recorder.add_cpu(self.flotilla_id, epoch, event.cpu_s)
                        continue
                    made = event.made
                    key = (event.index, made.worker, made.started) if made is not None else None
                    if key and key not in tasks:  # a task shared by several producers counts once
                        tasks.add(key)
                        # Images the flotilla received: one stream's batches (the others get the same ones).
                        counted = split is Split.TRAIN and flotilla.plan.hubs[event.hub].stream == 0
                        for path, reason in r.recorder.add_batch(made, train=counted):
                            r.progress.console.print(f"[yellow]warning[/] skipped {path}: {reason}")
                        r.recorder.add_cpu(self.flotilla_id, epoch, made.cpu_s)
                        r.recorder.add_cache(epoch, made.cache_hits, made.cache_lookups)
                    if event.hub in leads:
                        leads[event.hub] += 1
                        r.progress.update(task, completed=min(leads.values()))
                validation += self.boundary.forward(flotilla.poll())
                failures += drop_failed(flotilla)
                watch.check()
        finally:
            r.progress.remove_task(task)
        return validation, failures

    def _validation_reports(self, flotilla: Flotilla, early: list[ValReport]
                            ) -> tuple[list[ValReport], list[tuple[str, str]]]:
        """Every model's validation result of this epoch, and the groups that failed meanwhile."""
        reports = {report.model: report for report in early}
        failed: list[tuple[str, str]] = []
        deadline = time.monotonic() + self.run_ctx.report_s
        training = lambda: {m.name for member in flotilla.members.values() for m in member.group.members}
        while not training() <= set(reports):
            self.check_stop()
            if time.monotonic() > deadline:
                raise HangError(f"flotilla {self.flotilla_id}: no validation report from "
                                f"{sorted(training() - set(reports))} in {self.run_ctx.report_s:g} s "
                                "(timeouts.report_s)")
            for report in self.boundary.forward(flotilla.poll(timeout=1.0)):
                reports[report.model] = report
            failed += drop_failed(flotilla)
        return list(reports.values()), failed  # a model that reported and then failed finished its epoch


def drop_failed(flotilla: Flotilla) -> list[tuple[str, str]]:
    """Groups whose trainer failed leave at once: (name, why) of each."""
    failed = list(flotilla.failed_members().items())
    for name, _ in failed:
        flotilla.remove(name)
    return failed


class EpochBoundary:
    """A flotilla's epoch boundary, as its thread's main-thread commands ask: checkpoints written, models
    released, joiners attached to the running hub or laid out again with the flotilla, members leaving,
    and the last checkpoints as the run stops. It keeps what each member has finished and saved."""

    def __init__(self, thread: FlotillaThread):
        self.thread, self.run_ctx, self.flotilla_id = thread, thread.run_ctx, thread.flotilla_id
        self.reported: dict[str, int] = {}  # model -> epochs it has finished, as told to the main thread
        # model -> epochs of its newest checkpoint (where it started, or written since)
        self.saved: dict[str, int] = {m.name: member.start_epoch for member in thread.members
                                      for m in member.group.members}
        # model -> (its group, epochs) of the newest checkpoint its trainer was asked for
        self.asked: dict[str, tuple[str, int]] = {}
        self.saved_on_stop: dict[str, int] = {}  # group -> epochs
        self.taken_in: list[Member] = []  # their trainers started: attached to the running hub at the next boundary
        self.joining: list[Member] = []  # to lay the flotilla out again with, at the next epoch boundary

    def forward(self, reports: list[TrainerReport]) -> list[ValReport]:
        """Training reports go to the recorder; validation ones are returned."""
        validation = []
        for report in reports:
            if isinstance(report, ValReport):
                validation.append(report)
            elif isinstance(report, CheckpointSaved):
                self.saved[report.model] = report.epochs
            elif isinstance(report, TrainerDone):
                self.run_ctx.recorder.add_checksums(self.flotilla_id, report)
            elif isinstance(report, ResumedEarlier):
                self.saved.update(dict.fromkeys(report.models, report.epochs))
                self.run_ctx.progress.console.print(
                    f"flotilla {self.flotilla_id}: no checkpoint of {', '.join(report.models)} (group {report.group}) "
                    f"after {report.asked} epochs (its trainer died before writing it); they resume after "
                    f"{report.epochs}, and train the epochs between again")
            else:
                self.run_ctx.recorder.add_report(report)
                if report.compile_s and report.rank == 0 and report.spans:  # once a group: its first member's
                    self.run_ctx.progress.console.print(
                        f"flotilla {self.flotilla_id}: compiling took {report.compile_s:.1f} s of the steps of "
                        f"{report.model}'s group (trainer.compile)")
        return validation

    def apply(self, flotilla: Flotilla, epoch: int) -> None:
        """Applies the main thread's decisions at the boundary before `epoch`: checkpoints to write,
        models to release, joiners to take in, groups to stop."""
        thread = self.thread
        commands = list(iter(thread.commands.get, Continue()))
        thread.check_stop()
        wanted = {}  # (group, model) -> epochs
        for command in commands:
            if isinstance(command, SaveCheckpoints) and command.group in flotilla.members:
                training = {m.name for m in flotilla.members[command.group].group.members}
                wanted.update({(command.group, model): command.epochs for model in command.models
                               if model in training and self.saved.get(model) != command.epochs})
        leaving = [command.group for command in commands if isinstance(command, StopMember)]
        # Checkpoints of the groups that stay are written while they train on; a leaving group's trainers
        # are stopped, so its own are awaited first.
        self.save(flotilla, wanted, time.monotonic() + self.run_ctx.report_s, awaited=set(leaving))
        for command in commands:
            if isinstance(command, ReleaseModel) and command.group in flotilla.members:
                flotilla.release(command.group, command.model)  # before the next batch is published
        self.take_in(flotilla)
        stopped_early = [m for m in self.joining + self.taken_in if m.group.name in leaving]  # before they joined
        for member in stopped_early:
            flotilla.remove(member.group.name)
            leaving.remove(member.group.name)
            thread.events.put(MemberLeft(thread, member.group.name))
        self.joining = [m for m in self.joining if m not in stopped_early]
        self.taken_in = [m for m in self.taken_in if m not in stopped_early]
        for member in self.taken_in:  # before the leavers: a stream a joiner reads goes on
            flotilla.attach(member.group.name)
            self._joined(member, epoch, "attached")
        if self.taken_in:
            self.run_ctx.recorder.delivery_streams(self.flotilla_id, flotilla.plan)
        self.taken_in = []
        if flotilla.members and set(flotilla.members) <= set(leaving):  # everyone leaves: end the streams cleanly
            flotilla.stop()
            self.await_done(flotilla)
            self.run_ctx.recorder.add_hub_summaries(self.flotilla_id, flotilla.summaries)
        for group in leaving:
            flotilla.remove(group)
            thread.events.put(MemberLeft(thread, group))

    def lay_out_again(self, flotilla: Flotilla, epoch: int) -> list[Member]:
        """Models join at this epoch boundary that the running hub cannot take (`Flotilla.take_in`): the
        members still here are checkpointed after the epoch they finished (if the plan did not just do
        it), the streams end, and the members to lay out next are returned, each resuming from its
        checkpoint, the joiners with them; the stream's sequence of epochs goes on."""
        staying = list(flotilla.members.values())
        wanted = {(member.group.name, m.name): self.reported[m.name] for member in staying
                  for m in member.group.members if self.saved.get(m.name) != self.reported.get(m.name)}
        self.save(flotilla, wanted, time.monotonic() + self.run_ctx.report_s)
        if flotilla.members:
            flotilla.stop()
            self.await_done(flotilla)
            self.run_ctx.recorder.add_hub_summaries(self.flotilla_id, flotilla.summaries)
        joining, self.joining = self.joining, []
        for member in joining:
            self._joined(member, epoch, "laid out again")
        return [replace(member, start_epoch=self.saved[member.group.members[0].name]) for member in staying] + joining

    def take_in(self, flotilla: Flotilla) -> None:
        """Joiners whose streams the running hub makes start their trainers now, to read from the next
        epoch boundary on (their start overlaps this epoch); the others wait to be laid out with it."""
        joins = self.thread.joins
        while not joins.empty():
            member = joins.get_nowait().member
            taken = flotilla.take_in(member, self.run_ctx.graph.sinks, self.run_ctx.setup)
            (self.taken_in if taken else self.joining).append(member)

    def _joined(self, member: Member, epoch: int, how: str) -> None:
        self.saved.update({m.name: member.start_epoch for m in member.group.members})
        for m in member.group.members:  # new trainers: nothing asked of them yet
            self.asked.pop(m.name, None)
        self.run_ctx.recorder.joined(member.group, self.flotilla_id, member.devices, member.start_epoch, epoch, how)
        self.run_ctx.progress.console.print(
            f"flotilla {self.flotilla_id}: {member.group.name} joins its stream at epoch {epoch + 1} ({how})")

    def save(self, flotilla: Flotilla, wanted: dict[tuple[str, str], int], deadline: float,
             stopping: bool = False, awaited: set[str] | None = None) -> set[str]:
        """The trainers write the `wanted` checkpoints (those not asked for already). It waits for every
        checkpoint asked for and not yet written of the `awaited` groups in the flotilla (None: every group;
        a member released from a group that trains on, too), and returns the awaited groups whose every
        one is written; the others' CheckpointSaved come as they train on. A group that fails meanwhile is
        left to the next round; past `deadline` a stop goes on without the rest, a run fails (the trainer is
        hung)."""
        by_group: dict[tuple[str, int], list[str]] = {}
        for (group, model), epochs in wanted.items():
            if self.asked.get(model) != (group, epochs):
                by_group.setdefault((group, epochs), []).append(model)
                self.asked[model] = (group, epochs)
        for (group, epochs), models in by_group.items():
            flotilla.save(group, tuple(models), epochs)
        waiting = {(group, model): epochs for model, (group, epochs) in self.asked.items()
                   if (awaited is None or group in awaited) and group in flotilla.members}
        awaited_groups = {group for group, _ in waiting}
        while waiting:
            if not stopping:
                self.thread.check_stop()  # a stop request does not wait for a trainer that may be hung
            failed = flotilla.failed_members()
            waiting = {(group, model): epochs for (group, model), epochs in waiting.items()
                       if group not in failed and self.saved.get(model) != epochs}
            if not waiting:
                break
            if time.monotonic() > deadline:
                if stopping:
                    break
                raise HangError(f"flotilla {self.flotilla_id}: checkpoints of {sorted(m for _, m in waiting)} "
                                f"not written in {self.run_ctx.report_s:g} s (timeouts.report_s)")
            self.forward(flotilla.poll(timeout=0.2))
        return awaited_groups - {group for group, _ in waiting}

    def save_on_stop(self, flotilla: Flotilla) -> None:
        """The run stops: every member's last finished epoch (that the main thread knows of) is checkpointed."""
        failed = flotilla.failed_members()
        wanted = {(name, m.name): self.reported[m.name] for name, member in flotilla.members.items()
                  if name not in failed for m in member.group.members
                  if self.reported.get(m.name, 0) > self.saved.get(m.name, 0)}
        saved = self.save(flotilla, wanted, time.monotonic() + STOP_SAVE_SHARE * self.run_ctx.stop_s,
                          stopping=True)
        self.saved_on_stop = {group: epochs for (group, _), epochs in wanted.items() if group in saved}

    def await_done(self, flotilla: Flotilla) -> None:
        """After STOP: every hub's summary and every trainer's last report (its checksums), then exit."""
        waiting = {(name, rank) for name, m in flotilla.members.items() for rank in range(len(m.devices))}
        deadline = time.monotonic() + self.run_ctx.report_s
        while (waiting - {(name, rank) for name, rank in waiting if name in flotilla.failed_members()}
               or len(flotilla.summaries) < len(flotilla.plan.hubs)):
            self.thread.check_stop()
            if time.monotonic() > deadline:
                raise HangError(f"flotilla {self.flotilla_id}: trainers {sorted(waiting)} or hubs did not "
                                f"finish in {self.run_ctx.report_s:g} s (timeouts.report_s)")
            flotilla.hub_progress(timeout=0.1)
            reports = flotilla.poll(timeout=0.5)
            waiting -= {(r.group, r.rank) for r in reports if isinstance(r, TrainerDone)}
            self.forward(reports)
        flotilla.join(timeout=self.run_ctx.delivery.exit_s)


class Driver:
    """Carries out the scheduler's decisions. The scheduler places groups (a group of one is a model);
    convergence is each model's own: a converged model leaves its group, and the group leaves its
    flotilla (GroupConverged to the scheduler) with its last model."""

    def __init__(self, scheduler: Scheduler, groups: dict[str, GroupSpec], slot_devices: dict[Slot, str],
                 convergence: Convergence, run: RunContext, console: Console, agents: NodeAgents):
        self.scheduler, self.groups, self.slot_devices = scheduler, groups, slot_devices
        self.agents = agents  # the hosts' agents, as nodes are lost and return
        self.group_of = {m.name: group.name for group in groups.values() for m in group.members}
        self.convergence, self.run_ctx, self.console = convergence, run, console
        self.events: queue.Queue = queue.Queue()
        self.threads: dict[int, FlotillaThread] = {}  # running
        self.assigned: dict[str, tuple[Slot, ...]] = {}
        self.gone: set[str] = set()  # groups whose trainers failed: their flotilla already let them go
        self.broken: set[int] = set()  # flotillas that spanned a lost node: their threads are closing them
        self.freed_at_end: dict[int, list[Slot]] = {}  # broken flotilla -> the slots it held, freed as it ends
        self.converged: set[str] = set()  # models
        self.started = time.monotonic()
        self.log: list[dict] = []  # every decision, for results.json
        self.gantt = Gantt()  # who held which slot when, for results.json and the report's chart
        self.stopping = False  # a stop was requested: decisions are recorded, not carried out
        self.next_look = 0.0  # time.monotonic() of the next look for lost nodes' agents started again

    def now(self) -> float:
        return time.monotonic() - self.started

    @property
    def stranded(self) -> bool:
        """Nodes were lost, nothing runs, and no slot left can take the models still to train."""
        return bool(self.scheduler.stranded) and not self.threads

    @property
    def given_up(self) -> list[str]:
        """The models given up with their slot group once it failed more than allowed (not those that had
        converged and left it)."""
        return sorted(m.name for name, state in self.scheduler.groups.items() if state.status == FAILED
                      for m in self.groups[name].members if m.name not in self.converged)

    def resume(self) -> list:
        """Take back the state a stopped or crashed run saved in `state_dir`; the decisions that go on
        from it (its flotillas formed again, their models from their last checkpoints)."""
        state_dir = self.run_ctx.state_dir
        saved = json.loads((state_dir / "driver.json").read_text())
        self.log, self.converged = saved["log"], set(saved["converged"])
        self.gantt = Gantt([Bar.from_json(b) for b in saved["gantt"]])  # the stopped run's, ended then
        self.started = time.monotonic() - saved["now"]  # the scheduler's clock goes on
        self.run_ctx.recorder.load_state(state_dir / "recorder")
        return self.scheduler.restore(saved["scheduler"])

    def _save_state(self) -> None:
        state_dir = self.run_ctx.state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.run_ctx.recorder.save_state(state_dir / "recorder")
        now = self.now()
        write_json(state_dir / "driver.json", {"scheduler": self.scheduler.state(), "log": self.log,
                                               "gantt": [b.to_json() for b in self.gantt.until(now)],
                                               "converged": sorted(self.converged), "now": now})

    def run(self, first_decisions: list, stop: StopSignals) -> None:
        """Until the scheduler is done, or a stop request has ended every flotilla in order."""
        stop_by = None
        try:
            self._apply_decisions(first_decisions)
            self._save_state()
            while not (self.scheduler.done or (self.stopping and not self.threads) or self.stranded):
                if stop.requested.is_set() and not self.stopping:
                    self.stopping, stop_by = True, time.monotonic() + self.run_ctx.stop_s
                    for thread in self.threads.values():
                        thread.stop(stop_by)
                if self.scheduler.lost and not self.stopping and time.monotonic() >= self.next_look:
                    self.next_look = time.monotonic() + RETURN_POLL_S
                    self._look_for_returned_nodes()
                try:
                    event: ThreadEvent = self.events.get(timeout=EVENT_POLL_S)
                except queue.Empty:
                    if stop_by is not None and time.monotonic() > stop_by:
                        break  # flotillas that did not close in time are closed below
                    continue
                self._handle(event)
                self._save_state()
        finally:
            delivery = self.run_ctx.delivery
            by = stop_by or time.monotonic() + delivery.drain_s + 2 * delivery.exit_s
            for thread in self.threads.values():
                thread.stop(by)
            for thread in self.threads.values():  # its hubs drain, then its processes exit
                thread.join(timeout=max(by - time.monotonic(), 0.0))
        # A flotilla thread may fail while closing, after the scheduler is done: that is an error too.
        while not self.events.empty():
            event = self.events.get()
            if isinstance(event, ThreadFailed) and not (self.stopping or event.thread.flotilla_id in self.broken):
                raise event.error
        self.gantt.close(self.now())
        self._save_state()  # as the run ended: a resumed run's clock and Gantt chart go on from there

    def _handle(self, event: ThreadEvent) -> None:
        if isinstance(event, ThreadFailed):
            flotilla = event.thread.flotilla_id
            if not (self.stopping or flotilla in self.broken):
                raise event.error
            why = "while stopping" if self.stopping else "as it broke up"
            self.console.print(f"[yellow]flotilla {flotilla} failed {why}[/]: {event.error}")
        elif isinstance(event, EpochDone):
            if event.thread.flotilla_id in self.broken:  # its models redo the epoch from their checkpoints
                event.thread.commands.put(Continue())
            else:
                self._epoch_finished(event.thread, event.reports, event.failed)
        elif isinstance(event, MemberLeft):
            self._free_slots(event.group)
        elif isinstance(event, HostGone):
            self._host_lost(event.lost)
        elif isinstance(event, ThreadEnded):
            event.thread.join()
            self.threads.pop(event.thread.flotilla_id, None)
            self.broken.discard(event.thread.flotilla_id)
            for slot in self.freed_at_end.pop(event.thread.flotilla_id, []):
                self._free_slot(slot)
            for group, epochs in event.saved.items():
                self.scheduler.checkpointed(group, epochs)
                for model in self.groups[group].members:
                    self.run_ctx.recorder.checkpointed(model.name, epochs)

    def _free_slots(self, group: str) -> None:
        for slot in self.assigned.pop(group, ()):
            self._free_slot(slot)

    def _free_slot(self, slot: Slot) -> None:
        self._apply_decisions(self.scheduler.handle(SlotFreed(self.now(), slot)))

    def _host_lost(self, lost: HostLost) -> None:
        """Says which node was lost; its models count a failure; every flotilla spanning it breaks up, and
        the scheduler plans their models on the nodes left, from their last checkpoints."""
        node = self.agents.node_at(lost.address)
        if node in self.scheduler.lost:
            return
        self.broken |= {flotilla for flotilla, thread in self.threads.items() if node in thread.nodes}
        there = sorted(group for group, slots in self.assigned.items() if any(s.node == node for s in slots))
        self.agents.lose(node)  # first: an agent started again on that host keeps its new workers
        self.console.print(f"[red]node {node} lost[/]: {lost}; " + (
            f"{', '.join(there)} failed there, and " if there else "") + "the models of its flotillas resume from "
            "their last checkpoints on the nodes left")
        for group in there:
            for model in self.groups[group].members:
                self.run_ctx.recorder.failed(model.name, f"node {node} lost: {lost}")
        self._apply_decisions(self.scheduler.handle(NodeLost(self.now(), node)))

    def _look_for_returned_nodes(self) -> None:
        """Lost nodes whose agent was started again take flotillas again (the next plan may use them), once
        the flotillas that spanned lost nodes have closed (till then, their slots there are theirs)."""
        if self.broken:
            return
        for node in sorted(self.scheduler.lost):
            agent = self.agents.returned(node)
            if agent is None:
                continue
            cache = self.run_ctx.graph.cache
            if cache:  # the host's store now belongs to its new agent
                cache.node_owners[node] = agent["pid"]
            self.console.print(f"[green]node {node} is back[/]: its agent at {agent['address']} (pid {agent['pid']}) "
                               "takes flotillas again")
            self._apply_decisions(self.scheduler.handle(NodeReturned(self.now(), node)))

    def _trainer_failed(self, group: str, why: str) -> list:
        self.console.print(f"[red]trainer of {group} failed[/] ({why.strip().splitlines()[-1]}); "
                           "the scheduler resumes it from its last checkpoint")
        for model in self.groups[group].members:
            self.run_ctx.recorder.failed(model.name, why)
        self.gone.add(group)
        return self.scheduler.handle(TrainerFailed(self.now(), group, self.assigned[group][0], why))

    def _epoch_finished(self, thread: FlotillaThread, reports: list[ValReport], failed: list[tuple[str, str]]
                        ) -> None:
        decisions, converging = [], []
        cost = self.run_ctx.recorder.seconds_per_image()  # the run's own figure replaces the probe's
        if cost:
            decisions += self.scheduler.handle(PrepCostMeasured(self.now(), cost))
        by_group: dict[str, list[ValReport]] = {}
        for report in sorted(reports, key=lambda r: r.model):
            self.run_ctx.recorder.add_report(report)
            self.run_ctx.tracker.epoch(report.model, report.epoch + 1,
                                       self.run_ctx.recorder.epoch_metrics(report.model, report.epoch))
            by_group.setdefault(self.group_of[report.model], []).append(report)
            reason = self.convergence.reason(self.run_ctx.recorder.accuracies(report.model))
            if reason:
                converging.append((report.model, reason))
        halving = self.convergence.halving
        if halving:  # a member that has converged anyway is not culled
            done = {model for model, _ in converging}
            reached = [r.model for r in reports if r.model not in done]
            for model, reason in halving.culled(reached, self.run_ctx.recorder.by_epoch(halving.metric)).items():
                self.console.print(f"flotilla {thread.flotilla_id}: {model} {reason}")
                self.run_ctx.recorder.culled(model)
                converging.append((model, reason))
        for group, group_reports in by_group.items():
            metrics = {"val_accuracy": sum(r.accuracy for r in group_reports) / len(group_reports)}
            losses = [self.run_ctx.recorder.train_loss(r.model, r.epoch) for r in group_reports]
            if None not in losses:  # training phases (scheduler.phase_threshold) are read from it
                metrics[TRAIN_LOSS] = sum(losses) / len(losses)
            decisions += self.scheduler.handle(EpochFinished(self.now(), group, group_reports[0].epoch + 1, metrics))
        if reports:
            epoch = max(report.epoch for report in reports)
            ensemble = self.run_ctx.recorder.ensemble_accuracy.get(epoch)
            self.console.print(f"flotilla {thread.flotilla_id}: val accuracy " + ", ".join(
                f"{r.model} {r.accuracy:.1%} (epoch {r.epoch + 1})" for r in reports)
                + (f"; [bold]ensemble {ensemble:.1%}[/] (epoch {epoch + 1})" if ensemble is not None else ""))
        for model, reason in converging:
            self.run_ctx.recorder.converged(model, reason)
            self.converged.add(model)
        for group in sorted({self.group_of[model] for model, _ in converging}):
            members = self.groups[group].members
            if all(m.name in self.converged for m in members):
                culled = all(self.run_ctx.recorder.models[m.name].culled for m in members)
                decisions += self.scheduler.handle(GroupConverged(self.now(), group,
                                                                  "culled" if culled else "converged"))
                continue
            for model, reason in converging:  # the rest of its group trains on
                if self.group_of[model] == group and not self.stopping:
                    self.console.print(f"flotilla {thread.flotilla_id}: {model} leaves {group} ({reason})")
                    self._checkpoint(thread, group, (model,), self.scheduler.groups[group].epochs_done)
                    thread.commands.put(ReleaseModel(group, model))
        for group, why in failed:  # after the epoch they finished, before the survivors go on
            decisions += self._trainer_failed(group, why)
        self._apply_decisions(decisions)
        thread.commands.put(Continue())

    def _why(self, stop: Stop) -> str:
        """What a group's leaving is said as: a converged group's members' own reason where they share one
        (`reached trainer.epochs=8`, say), else the scheduler's."""
        if stop.reason != "converged":
            return stop.reason
        reasons = {self.run_ctx.recorder.models[m.name].converged for m in self.groups[stop.group].members}
        return reasons.pop() if len(reasons) == 1 and None not in reasons else stop.reason

    def _checkpoint(self, thread: FlotillaThread, group: str, models: tuple[str, ...], epochs: int) -> None:
        """`models` of `group` are checkpointed after `epochs` epochs before their flotilla goes on."""
        for model in models:
            self.run_ctx.recorder.checkpointed(model, epochs)
        thread.commands.put(SaveCheckpoints(group, models, epochs))

    def _member(self, group: str, resume_epoch: int) -> Member:
        """`group`'s models still training, on the slots assigned to it: a data-parallel world of as many
        (the scheduler's count, whatever the config asked)."""
        slots = self.assigned[group]
        return Member(self.groups[group].without(self.converged).on_slots(len(slots)),
                      tuple(self.slot_devices[s] for s in slots), tuple(s.node for s in slots), resume_epoch)

    def _apply_decisions(self, decisions: list) -> None:
        forming: dict[int, tuple[FormFlotilla, list[Member]]] = {}
        for decision in decisions:
            self.log.append({"t": round(self.now(), 3), "decision": type(decision).__name__,
                             **{k: str(v) for k, v in decision.__dict__.items()}})
            if self.stopping:  # the scheduler's state keeps them: a resumed run carries them out
                continue
            self.gantt.saw(decision, self.now())
            if isinstance(decision, FormFlotilla):
                forming[decision.flotilla] = (decision, [])
                self.run_ctx.recorder.planned(decision.flotilla, decision.rate, decision.start_s,
                                              self.scheduler.cluster.prep_seconds_per_image)
                planned = f"; planned {decision.rate:.0f} img/s" if not math.isnan(decision.rate) else ""
                planned += f" after a {decision.start_s:.1f} s start (compiling, graph capture)" \
                    if decision.start_s >= 1 else ""
                self.console.print(f"[bold]flotilla {decision.flotilla}[/] formed: " + ", ".join(
                    f"{m} on {n} slot{'s' * (n > 1)}" for m, n in decision.members.items()) + planned)
            elif isinstance(decision, AssignSlots):
                self.assigned[decision.group] = decision.slots
            elif isinstance(decision, (Start, Join)):
                self.gone.discard(decision.group)
                member = self._member(decision.group, decision.resume_epoch)
                if isinstance(decision, Join):  # its flotilla's thread takes it in (FlotillaThread._take_in)
                    self.threads[decision.flotilla].joins.put(JoinMember(member))
                else:
                    forming[decision.flotilla][1].append(member)
                    self.run_ctx.recorder.joined(member.group, decision.flotilla, member.devices,
                                                 decision.resume_epoch)
            elif isinstance(decision, Checkpoint):
                thread = self.threads.get(decision.flotilla)
                if thread is not None and decision.group not in self.gone:
                    models = tuple(m.name for m in self.groups[decision.group].members)
                    self._checkpoint(thread, decision.group, models, decision.epoch)
            elif isinstance(decision, Stop):
                self.console.print(f"flotilla {decision.flotilla}: {decision.group} leaves ({self._why(decision)})")
                if decision.flotilla in self.broken:  # its thread is closing its processes; the model may
                    # have new slots before it has closed (planned at once on the nodes left)
                    self.freed_at_end.setdefault(decision.flotilla, []).extend(self.assigned.pop(decision.group, ()))
                elif decision.group in self.gone:  # its trainers are already stopped
                    self.gone.discard(decision.group)
                    self._free_slots(decision.group)
                else:
                    self.threads[decision.flotilla].commands.put(StopMember(decision.group))
            else:
                raise TypeError(f"the driver cannot carry out {decision!r}")
        for flotilla_id, (formed, members) in forming.items():
            first = members[0]  # a flotilla's members joined it together
            before = self.run_ctx.recorder.epochs_before(flotilla_id, first.group.members[0].name, first.start_epoch)
            thread = FlotillaThread(formed, members, self.run_ctx, self.events, before)
            self.threads[flotilla_id] = thread
            thread.start()
