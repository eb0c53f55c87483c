"""The processes of a flotilla: its trainers, the hubs that feed them
(pipeline/hub.py, one per delivery group and node, as the topology plans
them) and the shared-memory rings between the two.

Owns their lifecycle: processes are spawned on entry and always stopped,
shared memory always unlinked, on exit, whatever happened in between. A
member can leave early (converged, or stopped by the scheduler): its readers
are detached and its processes stopped while the others train on.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from pipeline.graph import StageGraph
from pipeline.hub import HubSpec, hub_main
from pipeline.topology import DeliveryPlan, Hub
from pipeline.trainer import ModelSpec, TrainerSpec, trainer_main
from pipeline.transport.base import StreamLayout
from pipeline.transport.handoff import HANDOFF_PREFIX, remove_all
from pipeline.transport.shm import Ring
from stages.base import BadFileError, Spec, Split


@dataclass(frozen=True)
class Member:
    model: ModelSpec
    devices: tuple[str, ...]  # one per slot, rank order: "cpu" or "cuda:<i>"
    nodes: tuple[int, ...]  # the node of each slot
    start_epoch: int = 0  # epochs trained before: resume from its checkpoint


@dataclass(frozen=True)
class TrainingSetup:
    """What every trainer of a run shares."""

    num_classes: int
    epochs: int  # the most epochs a model trains
    steps_per_epoch: int
    threads: int
    checkpoint_dir: Path
    record_checksums: bool
    consume_only: bool


@dataclass(frozen=True)
class DeliverySetup:
    """What every hub of a run shares."""

    scheduler: str  # Dask scheduler address
    seed: int
    on_error: str
    in_flight: dict[int, int]  # node -> batch tasks a producer there keeps submitted
    ring_slots: int
    rendezvous_host: str


HUB_EXIT_S = 60  # what a closing hub gets to wind down (Executor: tasks running finish) before it is killed


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Flotilla:
    def __init__(self, members: list[Member], graph: StageGraph, plan: DeliveryPlan, setup: TrainingSetup,
                 delivery: DeliverySetup):
        self.members = {m.model.name: m for m in members}
        self.plan = plan
        self.context = mp.get_context("spawn")  # fork is unsafe with threads (Dask, torch)
        self.reports = self.context.Queue()  # trainers -> driver
        self.hub_events = self.context.Queue()  # hubs -> driver
        self.abort = self.context.Event()  # tells hubs to leave between batches
        self.processes: dict[str, list[mp.Process]] = defaultdict(list)
        self.hubs: list[tuple[mp.Process, object]] = []  # (process, its command queue), by rank
        self.readers: dict[str, list[tuple[Ring, int]]] = defaultdict(list)  # model -> (ring, reader) per rank
        self.rings: dict[tuple[int, str], Ring] = {}  # (hub rank, stream) -> ring
        self.errors: dict[str, str] = {}  # model -> traceback of a trainer that failed
        self.summaries: dict[int, dict] = {}  # hub rank -> what it moved, once stopped
        try:
            self._make_rings(graph, delivery.ring_slots)
            self._spawn_hubs(graph, setup, delivery)
            self._spawn_trainers(graph.sinks, setup)
        except BaseException:
            self.close()
            raise

    def _hub(self, member: Member, rank: int) -> Hub:
        return self.plan.hub_of(member.model.name, member.nodes[rank])

    def _make_rings(self, graph: StageGraph, slots: int) -> None:
        readers: dict[tuple[int, str], int] = defaultdict(int)
        for member in self.members.values():
            for rank in range(len(member.devices)):
                readers[self._hub(member, rank).rank, member.model.input] += 1
        for (hub, stream), count in sorted(readers.items()):
            layout = StreamLayout(graph.source.batch_size, graph.sinks[stream].item_shape)
            self.rings[hub, stream] = Ring(f"h{hub}-{stream}", layout, count, slots, self.context)

    def _spawn_hubs(self, graph: StageGraph, setup: TrainingSetup, delivery: DeliverySetup) -> None:
        rendezvous = f"tcp://{delivery.rendezvous_host}:{_free_port(delivery.rendezvous_host)}"
        all_groups = tuple(group.hubs for group in self.plan.groups)
        node_device = {node: device for m in self.members.values() for node, device in zip(m.nodes, m.devices)}
        # multi_broadcast groups make the same batches (of the whole flotilla's graph) under shared
        # task keys, so Dask makes each once while the groups keep within a window of each other.
        shared = self.plan.topology == "multi_broadcast" and len(self.plan.groups) > 1
        shared_keys = uuid.uuid4().hex[:8] if shared else None
        for hub in self.plan.hubs:
            group = self.plan.groups[hub.group]
            streams = {self.members[name].model.input for name in (self.members if shared else group.members)}
            spec = HubSpec(hub, group, all_groups, len(self.plan.hubs), rendezvous, node_device[hub.node],
                           delivery.scheduler, graph.feeding(streams), delivery.seed, delivery.on_error,
                           delivery.in_flight[hub.node],
                           {stream: ring for (rank, stream), ring in self.rings.items() if rank == hub.rank},
                           setup.record_checksums, shared_keys)
            commands = self.context.Queue()
            process = self.context.Process(target=hub_main, args=(spec, commands, self.hub_events, self.abort),
                                           name=f"hub-{hub.rank}-node{hub.node}", daemon=True)
            process.start()
            self.hubs.append((process, commands))

    def _spawn_trainers(self, sinks: dict[str, Spec], setup: TrainingSetup) -> None:
        next_reader: dict[tuple[int, str], int] = defaultdict(int)
        for member in self.members.values():
            model = member.model
            rendezvous = f"tcp://127.0.0.1:{_free_port('127.0.0.1')}"
            for rank, device in enumerate(member.devices):
                spec = TrainerSpec(model, setup.num_classes, sinks[model.input].item_shape[0], setup.epochs,
                                   member.start_epoch, setup.steps_per_epoch, rank, rendezvous, device,
                                   setup.threads, str(setup.checkpoint_dir), setup.record_checksums,
                                   setup.consume_only)
                key = (self._hub(member, rank).rank, model.input)
                ring, reader = self.rings[key], next_reader[key]
                next_reader[key] += 1
                process = self.context.Process(target=trainer_main, args=(spec, ring.reader(reader), self.reports),
                                               name=f"trainer-{model.name}-{rank}", daemon=True)
                process.start()
                self.processes[model.name].append(process)
                self.readers[model.name].append((ring, reader))

    def failed_members(self) -> dict[str, str]:
        """Members with a trainer that reported an error or died: name -> why."""
        failed = {name: self.errors[name] for name in self.members if name in self.errors}
        for name in self.members:
            dead = [p for p in self.processes[name] if p.exitcode is not None]
            if dead and name not in failed:
                failed[name] = f"{dead[0].name} exited with code {dead[0].exitcode}"
        return failed

    def __enter__(self) -> Flotilla:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run_split(self, split: Split, epoch: int) -> None:
        """Every hub delivers the split's epoch; `hub_progress` says how far they are."""
        for _, commands in self.hubs:
            commands.put((split.value, epoch))

    def hub_progress(self, timeout: float) -> list[tuple]:
        """Events from the hubs so far, waiting up to `timeout` for the first:
        ("batch", rank, split, index, batch stats or None) or ("split_done", rank, ...).
        A hub that failed stops the run: it carries every member of its group."""
        events = []
        try:
            events.append(self.hub_events.get(timeout=timeout))
            while True:
                events.append(self.hub_events.get_nowait())
        except queue.Empty:
            pass
        for kind, rank, *rest in events:
            if kind == "bad_file":
                raise BadFileError(rest[0])
            if kind == "error":
                raise RuntimeError(f"hub {rank} (node {self.plan.hubs[rank].node}) failed:\n{rest[0]}")
            if kind == "stopped":
                self.summaries[rank] = rest[0]
        for (process, _), hub in zip(self.hubs, self.plan.hubs):
            if process.exitcode not in (None, 0):
                raise RuntimeError(f"hub {hub.rank} (node {hub.node}) exited with code {process.exitcode}")
        return [event for event in events if event[0] in ("batch", "split_done")]

    def stop(self) -> None:
        """The run is over for every member: hubs send STOP down the rings and report what they moved."""
        for _, commands in self.hubs:
            commands.put(None)

    def remove(self, name: str) -> None:
        """Stop a member's trainers now; its last checkpoint is its state."""
        member = self.members.pop(name, None)
        if member is None:  # already gone (it failed)
            return
        for ring, reader in self.readers[name]:
            ring.detach(reader)
        _stop_processes(self.processes[name])

    def poll(self, timeout: float | None = None) -> list[dict]:
        """Reports from trainers so far (waiting up to `timeout` for the first)."""
        events = []
        try:
            events.append(self.reports.get(timeout=timeout) if timeout else self.reports.get_nowait())
            while True:
                events.append(self.reports.get_nowait())
        except queue.Empty:
            pass
        for event in events:
            if event["event"] == "error":
                self.errors[event["model"]] = f"rank {event['rank']} raised:\n{event['traceback']}"
        return [event for event in events if event["event"] != "error"]

    def join(self, timeout: float) -> None:
        for process in [p for processes in self.processes.values() for p in processes] + [p for p, _ in self.hubs]:
            process.join(timeout)

    def close(self) -> None:
        try:
            self.abort.set()
            for _, commands in self.hubs:
                commands.put(None)
            _stop_processes([p for processes in self.processes.values() for p in processes])
            for ring in self.rings.values():  # no hub waits on a trainer that is gone
                for reader in range(ring.consumers):
                    ring.detach(reader)
            for process, _ in self.hubs:  # a hub in the middle of a split lets its batch tasks finish first
                process.join(HUB_EXIT_S)
            _stop_processes([p for p, _ in self.hubs])
            for process, _ in self.hubs:  # hand-off files of batch tasks a stopped hub never took
                remove_all(f"{HANDOFF_PREFIX}-{process.pid}-")
        finally:
            for ring in self.rings.values():
                ring.close()
            for q in [self.reports, self.hub_events] + [commands for _, commands in self.hubs]:
                q.close()
                q.join_thread()


def _stop_processes(processes: list[mp.Process]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
