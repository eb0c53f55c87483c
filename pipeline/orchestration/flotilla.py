"""The processes of a flotilla: its trainers, the hubs that feed them
(pipeline/delivery/hub.py, one per stream and node, as the topology plans
them) and the shared-memory rings between the two, on every node it spans.

Each node's share lives in a NodeProcesses (pipeline/orchestration/agent.py), in this
process or in the agent of a real host; this class lays the flotilla out
over them and merges what they report. Processes are started on entry and
always stopped, shared memory always unlinked, on exit, whatever happened in
between. A member can leave early (converged, or stopped by the scheduler):
its readers are detached and its trainers stopped while the others train on.
"""
from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass, replace

from pipeline.data.executor import TlsFiles
from pipeline.data.graph import StageGraph
from pipeline.delivery.hub import HubSpec
from pipeline.delivery.messages import (BatchPublished, HubFailed, HubHung, HubStopped, HubUserError, HubWaiting,
                                        RunSplit, SplitDone, StopStreams)
from pipeline.delivery.stream import MessageLayout
from pipeline.delivery.plan import DeliveryPlan, HubPlan, Topology
from pipeline.runtime.errors import UserError
from pipeline.runtime.hang import HangError, Patience, shared_out
from pipeline.runtime.lifetime import how_it_ended
from pipeline.orchestration.agent import Laggard, node_processes
from pipeline.training.reports import TrainerError, TrainerReport
from pipeline.training.group import GroupSpec
from pipeline.training.trainer import TrainerSpec, TrainingSetup
from stages.base import OnError, Spec, Split


@dataclass(frozen=True)
class Member:
    """A group (pipeline/training/group.py) on its slots: one trainer per slot."""

    group: GroupSpec
    devices: tuple[str, ...]  # one per slot, rank order: "cpu" or "cuda:<i>"
    nodes: tuple[int, ...]  # the node of each slot
    start_epoch: int = 0  # epochs trained before: resume from its checkpoint


@dataclass(frozen=True, kw_only=True)  # many fields: called by name, never by position
class DeliverySetup:
    """What every hub of a run shares."""

    scheduler: str  # Dask scheduler address
    seed: int
    on_error: OnError
    in_flight: dict[int, int]  # node -> batch tasks a producer there keeps submitted
    ring_depth: int  # batches each ring holds
    agents: dict[int, dict]  # node -> its host's agent (python -m pipeline.node); none: nodes simulated here
    agent_key: bytes | None  # the secret the agents were started with (cluster.agent_key_file)
    tls: TlsFiles | None  # cluster.tls, for the hubs of nodes simulated here
    drain_s: float  # timeouts.drain_s
    exit_s: float  # timeouts.exit_s
    patience: Patience  # timeouts.warn_s, stall_s
    collective_s: float  # timeouts.collective_s
    host_s: float  # timeouts.host_s: a node agent silent this long is lost
    join_readers: int  # scheduler.join_running: spare readers in each ring of a one-hub flotilla (a node's slots)


class Flotilla:
    def __init__(self, flotilla_id: int, members: list[Member], graph: StageGraph, plan: DeliveryPlan,
                 setup: TrainingSetup, delivery: DeliverySetup):
        self.id = flotilla_id
        self.members = {m.group.name: m for m in members}
        self.joiners: dict[str, Member] = {}  # taken in, their trainers waiting to be attached
        self.plan = plan
        self.nodes = {}  # node -> its NodeProcesses (or a proxy to it in the host's agent)
        self.errors: dict[str, str] = {}  # group -> traceback of a trainer that failed
        self.summaries: dict[int, dict] = {}  # hub rank -> what it moved, once stopped
        self.closed = False
        self.driver_links = []  # held open while the agents' processes live (NodeProcesses.watch_driver)
        self.waiting: dict[int, str] = {}  # hub rank -> what it said it waits for (HubWaiting), until it publishes
        try:
            for node in sorted({hub.node for hub in plan.hubs} | {n for m in members for n in m.nodes}):
                self.nodes[node], link = node_processes(node, delivery.agents, delivery.drain_s,
                                                        delivery.agent_key, delivery.tls, delivery.host_s)
                self.driver_links += [link] if link else []
            self._make_rings(graph, delivery.ring_depth, delivery.join_readers if len(plan.hubs) == 1 else 0)
            self._start_hubs(graph, setup, delivery)
            self._start_trainers(graph.sinks, setup)
        except BaseException:
            self.close()
            raise

    def _hub(self, member: Member, rank: int) -> HubPlan:
        return self.plan.hub_of(member.group.name, member.nodes[rank])

    def _make_rings(self, graph: StageGraph, depth: int, spare: int) -> None:
        readers: dict[tuple[int, str], int] = defaultdict(int)
        for member in self.members.values():
            for rank in range(len(member.devices)):
                for sink in member.group.inputs:
                    readers[self._hub(member, rank).rank, sink] += 1
        for (hub, sink), count in sorted(readers.items()):
            layout = MessageLayout(graph.source.batch_size, graph.sinks[sink].item_shape)
            self.nodes[self.plan.hubs[hub].node].make_ring(hub, sink, layout, count, depth, spare)

    def _start_hubs(self, graph: StageGraph, setup: TrainingSetup, delivery: DeliverySetup) -> None:
        rendezvous = self.nodes[self.plan.hubs[0].node].rendezvous({hub.node for hub in self.plan.hubs})
        stream_ranks = tuple(stream.hubs for stream in self.plan.streams)
        node_device = {node: device for m in self.members.values() for node, device in zip(m.nodes, m.devices)}
        # multi_broadcast streams make the same batches (of the whole flotilla's graph) under shared
        # task keys, so Dask makes each once while the streams keep within a window of each other.
        shared = self.plan.topology == Topology.multi_broadcast and len(self.plan.streams) > 1
        shared_keys = uuid.uuid4().hex[:8] if shared else None
        for hub in self.plan.hubs:
            stream = self.plan.streams[hub.stream]
            sinks = {sink for name in (self.members if shared else stream.members)
                     for sink in self.members[name].group.inputs}
            self.nodes[hub.node].start_hub(HubSpec(
                hub=hub, stream=stream, stream_ranks=stream_ranks, world=len(self.plan.hubs), rendezvous=rendezvous,
                device=node_device[hub.node], scheduler=delivery.scheduler, graph=graph.feeding(sinks),
                seed=delivery.seed, on_error=delivery.on_error, in_flight=delivery.in_flight[hub.node], rings={},
                record_checksums=setup.record_checksums, shared_keys=shared_keys, sequence=self.id,
                drain_s=delivery.drain_s, patience=delivery.patience, collective_s=delivery.collective_s, tls=None))

    def _start_trainers(self, sinks: dict[str, Spec], setup: TrainingSetup) -> None:
        next_reader: dict[tuple[int, str], int] = defaultdict(int)
        for member in self.members.values():
            self._start_member(member, sinks, setup, next_reader)

    def _start_member(self, member: Member, sinks: dict[str, Spec], setup: TrainingSetup,
                      next_reader: dict[tuple[int, str], int] | None) -> None:
        """`member`'s trainers, each reading as the next reader of its hub's rings (`next_reader`, counted
        on), or as a spare reader joining the running stream (None)."""
        group = member.group
        rendezvous = self.nodes[member.nodes[0]].rendezvous(set(member.nodes))  # rank 0 hosts the group
        for rank, (device, node) in enumerate(zip(member.devices, member.nodes)):
            spec = TrainerSpec(setup=setup, group=group,
                               image_sizes={s: sinks[s].item_shape[0] for s in group.inputs},
                               start_epoch=member.start_epoch, rank=rank, rendezvous=rendezvous, device=device)
            if next_reader is None:  # a joiner: spare readers of the flotilla's one hub
                self.nodes[node].start_trainer(spec, self.plan.hubs[0].rank)
                continue
            hub = self._hub(member, rank).rank
            self.nodes[node].start_trainer(spec, hub, {sink: next_reader[hub, sink] for sink in group.inputs})
            for sink in group.inputs:
                next_reader[hub, sink] += 1

    def take_in(self, member: Member, sinks: dict[str, Spec], setup: TrainingSetup) -> bool:
        """`member` joins the running stream: its trainers start now, as spare readers of the hub's rings,
        and wait for `attach` at the next epoch boundary; the other members train on untouched. False
        (nothing started) if the flotilla has more than one hub, its hub does not make every sink
        `member` reads, or too few spare readers are left: it is then laid out again with `member`."""
        if len(self.plan.hubs) != 1:
            return False
        hub = self.plan.hubs[0]
        node = self.nodes[hub.node]
        ranks = len(member.devices)
        if set(member.nodes) != {hub.node} or any(node.spare_readers(hub.rank, sink) < ranks
                                                   for sink in member.group.inputs):
            return False
        self.joiners[member.group.name] = member
        self._start_member(member, sinks, setup, None)
        return True

    def attach(self, group: str) -> None:
        """A member taken in reads the hub's messages from the next on (call it between epochs)."""
        member = self.joiners.pop(group)
        self.nodes[member.nodes[0]].attach(group)
        self.members[group] = member
        self.plan = self.plan.joined(group)

    def failed_members(self) -> dict[str, str]:
        """Groups with a trainer that reported an error or died: name -> why. A trainer that exited with code 0
        did neither: it sent TrainerDone, its last message, which may still be on its way."""
        failed = {name: self.errors[name] for name in self.members if name in self.errors}
        for node in self.nodes.values():
            for name, trainers in node.trainer_exit_codes().items():
                dead = [(process, code) for process, code in trainers if code]
                if dead and name in self.members and name not in failed:
                    process, code = dead[0]
                    failed[name] = f"{process} (training {self.members[name].group.describe()}) {how_it_ended(code)}"
        return failed

    def __enter__(self) -> Flotilla:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run_split(self, split: Split, epoch: int) -> None:
        """Every hub delivers the split's epoch (of this flotilla's sequence); `hub_progress` says how far."""
        for node in self.nodes.values():
            node.command_hubs(RunSplit(split, epoch))

    def hub_progress(self, timeout: float) -> list[BatchPublished | SplitDone]:
        """Progress of the hubs so far, waiting up to `timeout` (shared out over the nodes) for the first.
        A hub that failed stops the run: it carries every member of its stream."""
        events = [event for node in self.nodes.values() for event in node.hub_progress(timeout / len(self.nodes))]
        dead = [(rank, code) for node in self.nodes.values() for rank, code in node.hub_exit_codes().items()
                if code not in (None, 0)]
        if dead:  # what a hub said before it exited explains it best: take what is left of its words first
            events += [event for node in self.nodes.values() for event in node.hub_progress(0)]
        user_errors = [event for event in events if isinstance(event, HubUserError)]
        if user_errors:  # first: a peer in a collective with the hub that stopped for it may fail after it
            raise UserError(user_errors[0].message)
        for event in events:
            if isinstance(event, HubHung):
                raise HangError(f"hub {event.hub} (node {self.plan.hubs[event.hub].node}): {event.message}")
            if isinstance(event, HubWaiting):
                self.waiting[event.hub] = event.what
            elif isinstance(event, BatchPublished | SplitDone):
                self.waiting.pop(event.hub, None)
            if isinstance(event, HubFailed):
                raise RuntimeError(f"hub {event.hub} (node {self.plan.hubs[event.hub].node}) failed:\n"
                                   f"{event.traceback}")
            if isinstance(event, HubStopped):
                self.summaries[event.hub] = event.summary
        for rank, code in dead:
            raise RuntimeError(f"hub {rank} (node {self.plan.hubs[rank].node}) {how_it_ended(code)}")
        return [event for event in events if isinstance(event, (BatchPublished, SplitDone))]

    def laggards(self) -> list[Laggard]:
        """Trainers that hold every buffer of a ring: its hub waits for them."""
        return [laggard for node in self.nodes.values() for laggard in node.laggards()]

    def stop(self) -> None:
        """The run is over for every member: hubs send STOP down the rings and report what they moved."""
        for node in self.nodes.values():
            node.command_hubs(StopStreams())

    def release(self, group: str, model: str) -> None:
        """`model` leaves `group`, whose other models train on; its last checkpoint is its state."""
        member = self.members[group]
        self.members[group] = replace(member, group=member.group.without({model}))
        for node in sorted(set(member.nodes)):
            self.nodes[node].release(group, model)

    def save(self, group: str, models: tuple[str, ...], epochs: int) -> None:
        """The group's rank 0 writes `models`' checkpoints after `epochs` epochs (CheckpointSaved follows)."""
        self.nodes[self.members[group].nodes[0]].save(group, models, epochs)

    def remove(self, name: str) -> None:
        """Stop a group's trainers now; the last checkpoints of its models are their state."""
        member = self.members.pop(name, None) or self.joiners.pop(name, None)
        if member is None:  # already gone (it failed)
            return
        for node in sorted(set(member.nodes)):
            self.nodes[node].remove(name)

    def poll(self, timeout: float | None = None) -> list[TrainerReport]:
        """Reports from trainers so far (waiting up to `timeout`, shared out over the nodes, for the first);
        errors are kept for `failed_members`."""
        reports = [report for node in self.nodes.values() for report in node.poll((timeout or 0) / len(self.nodes))]
        for report in reports:
            if isinstance(report, TrainerError):
                self.errors[report.group] = f"rank {report.rank} raised:\n{report.traceback}"
        return [report for report in reports if not isinstance(report, TrainerError)]

    def join(self, timeout: float) -> None:
        """Waits up to `timeout` seconds in all for the processes of every node to end by themselves."""
        for node, left in shared_out(timeout, self.nodes.values()):
            node.join(left)

    def close(self, within: float | None = None) -> None:
        """Stop every process and free the rings (at once, and once). `within`: seconds the whole
        may take (a stopping run's), instead of the timeouts' drain and exit time."""
        if self.closed:
            return
        self.closed = True
        errors = []
        for node in self.nodes.values():  # each node is closed, whatever another one raised
            try:
                node.close(within / len(self.nodes) if within is not None else None)
            except BaseException as err:
                errors.append(err)
        for link in self.driver_links:  # closed: the agents' watch sees the flotilla's end, not the driver's
            link.close()
        if errors:
            raise errors[0]
