"""The driver's main thread, with stand-in flotilla threads: what it tells a flotilla after a round,
in which order; and the scheduler's state it saves, which a resumed run continues from."""
import io
import queue
import time
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

import pipeline.orchestration.driver as driver_module
from pipeline.measure.recorder import RunRecorder
from pipeline.measure.tracking import Tracker
from pipeline.orchestration.driver import (Continue, Convergence, Driver, EpochDone, ReleaseModel, RunContext,
                                           SaveCheckpoints, StopMember)
from pipeline.orchestration.agent import NodeAgents
from pipeline.scheduler import (Checkpoint, Cluster, EpochFinished, FleetG, FormFlotilla, RatesMeasured, Scheduler,
                                Slot, Start)
from pipeline.training.group import GroupSpec
from tests.conftest import member
from pipeline.training.reports import ValReport

LABELS = np.array([0, 1])


class StandIn:
    """A flotilla thread that only takes the main thread's commands."""

    def __init__(self, formed, members, run, events, first_epoch=0):
        self.flotilla_id, self.members = formed.flotilla, members
        self.commands: queue.Queue = queue.Queue()

    @property
    def nodes(self) -> set[int]:
        return {node for member in self.members for node in member.nodes}

    def start(self):
        pass

    def join(self):
        pass

    def taken(self) -> list:
        return [self.commands.get_nowait() for _ in range(self.commands.qsize())]


class Agents(NodeAgents):
    """NodeAgents without a Dask scheduler: `registered` stands for what agents registered there."""

    def __init__(self, agents: dict[int, dict]):
        super().__init__(None, agents)
        self.registered, self.lost = dict(agents), []

    def lose(self, node: int) -> None:
        self.lost.append(node)

    def returned(self, node: int) -> dict | None:
        if self.registered[node] == self.agents[node]:
            return None
        self.agents[node] = self.registered[node]
        return self.agents[node]


def spec(name):
    return member(name)


def report(model, epoch):
    return ValReport(model, epoch, 0.5, np.array([[0.6, 0.4], [0.6, 0.4]], np.float32), LABELS)


def driver_of(groups: list[GroupSpec], tmp_path, monkeypatch, epochs=5) -> Driver:
    monkeypatch.setattr(driver_module, "FlotillaThread", StandIn)
    models = [m for g in groups for m in g.members]
    scheduler = Scheduler([g.name for g in groups], Cluster(1, len(groups)), FleetG(min_active_fraction=0.8),
                          checkpoint_every=2)
    recorder = RunRecorder(models, {m.name: 1 for m in models}, {m.name: 32 for m in models})
    context = RunContext(graph=None, setup=None, delivery=None, recorder=recorder,
                         tracker=Tracker(tmp_path, models, tensorboard=False), progress=None, report_s=60.0,
                         stop_s=10.0, state_dir=tmp_path / "state")
    slots = {Slot(0, i): "cpu" for i in range(len(groups))}
    driver = Driver(scheduler, {g.name: g for g in groups}, slots, Convergence(epochs, None, 0, 0.005), context,
                    Console(file=io.StringIO()), Agents({}))
    decisions = [d for g in groups for d in scheduler.handle(RatesMeasured(0.0, g.name, (10.0,)))]
    driver._apply_decisions(decisions)
    return driver


def two_node_driver(tmp_path, monkeypatch, policy, slots_per_node: int = 1, said: io.StringIO | None = None
                    ) -> Driver:
    """A driver of models a and b on 2 nodes of `slots_per_node` slots each, whose agents are at
    198.51.100.2:4000 (pid 10) and 198.51.100.3:4000 (pid 11); its flotilla threads are stand-ins."""
    from types import SimpleNamespace

    monkeypatch.setattr(driver_module, "FlotillaThread", StandIn)
    models = [spec("a"), spec("b")]
    scheduler = Scheduler(["a", "b"], Cluster(2, slots_per_node), policy)
    recorder = RunRecorder(models, {m.name: 1 for m in models}, {m.name: 32 for m in models})
    agents = {0: {"address": "198.51.100.2:4000", "pid": 10}, 1: {"address": "198.51.100.3:4000", "pid": 11}}
    delivery = SimpleNamespace(agents=agents, drain_s=1.0, exit_s=1.0)
    context = RunContext(graph=SimpleNamespace(cache=None), setup=None, delivery=delivery, recorder=recorder,
                         tracker=Tracker(tmp_path, models, tensorboard=False), progress=None, report_s=60.0,
                         stop_s=10.0, state_dir=tmp_path / "s")
    return Driver(scheduler, {m.name: GroupSpec(m.name, (m,)) for m in models},
                  {Slot(n, i): "cpu" for n in (0, 1) for i in range(slots_per_node)}, Convergence(5, None, 0, 0.005),
                  context, Console(file=said or io.StringIO(), width=400), Agents(agents))


def test_a_failure_in_the_round_of_an_epoch_stops_the_survivors_before_they_go_on(tmp_path, monkeypatch):
    """a and b finish epoch 1; a's trainer dies in the same round. FLEET stops the flotilla (half its slots
    idle): b must hear StopMember before Continue, or it would train an epoch it was stopped from."""
    driver = driver_of([GroupSpec("a", (spec("a"),)), GroupSpec("b", (spec("b"),))], tmp_path, monkeypatch)
    thread = driver.threads[0]
    driver._handle(EpochDone(thread, [report("a", 0), report("b", 0)], [("a", "rank 0 exited with code -9")]))
    commands = thread.taken()
    assert commands == [SaveCheckpoints("b", ("b",), 1), StopMember("b"), Continue()], commands


def test_checkpoints_follow_the_schedule_and_a_converged_member_is_saved_before_it_leaves(tmp_path, monkeypatch):
    """scheduler.checkpoint_every=2: epoch 1 asks nothing, epoch 2 saves the group; a member that converges
    alone in its group gets its final checkpoint, then leaves, the others training on."""
    group = GroupSpec("g", (spec("a"), spec("b")))
    driver = driver_of([group], tmp_path, monkeypatch, epochs=5)
    thread = driver.threads[0]
    driver._handle(EpochDone(thread, [report("a", 0), report("b", 0)], []))
    assert thread.taken() == [Continue()]
    driver._handle(EpochDone(thread, [report("a", 1), report("b", 1)], []))
    assert thread.taken() == [SaveCheckpoints("g", ("a", "b"), 2), Continue()]
    driver.convergence = Convergence(5, 0.99, 0, 0.005)  # a reaches it at epoch 3
    converged = ValReport("a", 2, 1.0, np.array([[0.9, 0.1], [0.1, 0.9]], np.float32), LABELS)
    driver._handle(EpochDone(thread, [converged, report("b", 2)], []))
    assert thread.taken() == [SaveCheckpoints("g", ("a",), 3), ReleaseModel("g", "a"), Continue()]


def test_the_saved_state_forms_the_running_flotillas_again_from_their_checkpoints(tmp_path, monkeypatch):
    """What a resumed run starts from: the flotilla that was running, on the same slots, each model from
    its last checkpoint (what it did after is done again), the decisions log and the clock going on."""
    groups = [GroupSpec("a", (spec("a"),)), GroupSpec("b", (spec("b"),))]
    driver = driver_of(groups, tmp_path, monkeypatch)
    thread = driver.threads[0]
    for epoch in range(3):
        driver._handle(EpochDone(thread, [report("a", epoch), report("b", epoch)], []))
    driver._save_state()
    again = driver_of(groups, tmp_path, monkeypatch)
    again.scheduler = Scheduler(["a", "b"], Cluster(1, 2), FleetG(min_active_fraction=0.8), checkpoint_every=2)
    decisions = again.resume()
    assert [type(d) for d in decisions if isinstance(d, (FormFlotilla, Start))] == [FormFlotilla, Start, Start]
    assert [(d.group, d.resume_epoch) for d in decisions if isinstance(d, Start)] == [("a", 2), ("b", 2)]
    assert again.now() >= driver.now() - 1 and again.log[:len(driver.log)] == driver.log
    assert again.run_ctx.recorder.accuracies("a") == [0.5, 0.5, 0.5]
    again._apply_decisions(decisions)  # joining again after 2 epochs forgets epoch 3: it is done again
    assert again.run_ctx.recorder.accuracies("a") == [0.5, 0.5]
    assert not any(isinstance(d, Checkpoint) for d in decisions)


def test_a_lost_node_fails_its_models_frees_the_slots_once_its_flotilla_closed_and_strands_what_cannot_fit(
        tmp_path, monkeypatch):
    """scheduler=shared, a on node 0 and b on node 1, one flotilla. Node 1's agent stops answering: one line
    names the node and the agent's address; b counts a failure, a does not; the slots are free only once the
    flotilla's thread has closed what it could reach; then nothing left can take both: the run stops."""
    from pipeline.orchestration.driver import HostGone, ThreadEnded
    from pipeline.orchestration.agent import HostLost
    from pipeline.runtime.lifetime import StopSignals
    from pipeline.scheduler import Shared

    said = io.StringIO()
    driver = two_node_driver(tmp_path, monkeypatch, Shared({"a": 1, "b": 1}), said=said)
    scheduler, recorder = driver.scheduler, driver.run_ctx.recorder
    driver._apply_decisions(scheduler.start(0.0))
    thread = driver.threads[0]
    driver._handle(HostGone(thread, HostLost("198.51.100.3:4000", "EOFError")))
    (line,) = [line for line in said.getvalue().splitlines() if "lost" in line and "answer" in line]
    assert line.startswith("node 1 lost: the agent at 198.51.100.3:4000 does not answer (EOFError); b failed there")
    assert recorder.models["a"].failures == [] and len(recorder.models["b"].failures) == 1
    assert recorder.models["b"].failures[0].startswith("node 1 lost: the agent at 198.51.100.3:4000")
    assert driver.agents.lost == [1]  # Dask was told the node's workers are gone
    assert driver.freed_at_end == {0: [Slot(0, 0), Slot(1, 0)]}  # its processes may still run: no slot is free yet
    assert not driver.stranded
    driver._handle(ThreadEnded(thread, {}))
    assert driver.freed_at_end == driver.assigned == {} and scheduler.stranded == ["a", "b"] and driver.stranded
    with StopSignals() as stop:
        driver.run([], stop)  # returns at once: nothing can go on
    assert [d["decision"] for d in driver.log][-2:] == ["Stop", "Stop"]


def test_a_checkpoint_beyond_what_a_model_did_is_refused():
    scheduler = Scheduler(["a"], Cluster(1, 1), FleetG())
    scheduler.handle(RatesMeasured(0.0, "a", (10.0,)))
    with pytest.raises(ValueError, match="a checkpoint after 1 epochs, but it has done 0"):
        scheduler.checkpointed("a", 1)


def test_a_lost_node_whose_agent_is_started_again_takes_the_waiting_model(tmp_path, monkeypatch):
    """scheduler=baseline, a on node 0 and b on node 1, each a flotilla of its own. Node 1 is lost: b waits,
    since a holds node 0's slot. An agent registered again for node 1 is not looked for while b's broken
    flotilla still closes; once it has, the driver says node 1 is back, the flotillas reach it at its new
    agent, and b resumes there from its checkpoint."""
    from pipeline.orchestration.driver import HostGone, ThreadEnded
    from pipeline.orchestration.agent import HostLost
    from pipeline.scheduler import Baseline

    said = io.StringIO()
    driver = two_node_driver(tmp_path, monkeypatch, Baseline(), said=said)
    scheduler, hosts, agents = driver.scheduler, driver.agents, driver.agents.agents
    driver._apply_decisions([d for m in "ab" for d in scheduler.handle(RatesMeasured(0.0, m, (10.0,)))])
    (on_1,) = [thread for thread in driver.threads.values() if thread.nodes == {1}]
    assert on_1.members[0].group.name == "b"
    driver._apply_decisions(scheduler.handle(EpochFinished(driver.now(), "b", 1, {"val_accuracy": 0.5})))
    scheduler.checkpointed("b", 1)
    driver._handle(HostGone(on_1, HostLost("198.51.100.3:4000", "silent for timeouts.host_s=30 s")))
    hosts.registered[1] = {"address": "198.51.100.3:4100", "pid": 12}  # started again, elsewhere on the host
    driver._look_for_returned_nodes()
    assert "back" not in said.getvalue() and agents[1]["pid"] == 11  # b's flotilla still closes: not yet
    driver._handle(ThreadEnded(on_1, {}))
    assert not driver.broken and scheduler.groups["b"].status == "waiting"
    driver._look_for_returned_nodes()
    (line,) = [line for line in said.getvalue().splitlines() if "back" in line]
    assert line == "node 1 is back: its agent at 198.51.100.3:4100 (pid 12) takes flotillas again"
    assert agents[1]["pid"] == 12 and scheduler.lost == set()
    (again,) = [thread for thread in driver.threads.values() if thread.nodes == {1}]
    assert again is not on_1 and again.members[0].group.name == "b" and again.members[0].start_epoch == 1


def test_a_lost_nodes_models_resume_at_once_on_free_slots_and_keep_them_while_the_old_flotillas_close(
        tmp_path, monkeypatch):
    """scheduler=baseline on 2 nodes of 2 slots: a and b on node 0 (best fit), node 1 free. Node 0 is lost:
    both resume at once on node 1 while their broken flotillas still close. When those end they free the
    slots they held (node 0's, lost), never the ones their models hold now. (The mistake this catches: the
    slots freed at a broken flotilla's end looked up by model, after the model had new ones.)"""
    from pipeline.orchestration.driver import HostGone, ThreadEnded
    from pipeline.orchestration.agent import HostLost
    from pipeline.scheduler import Baseline

    driver = two_node_driver(tmp_path, monkeypatch, Baseline(), slots_per_node=2)
    scheduler = driver.scheduler
    driver._apply_decisions([d for m in "ab" for d in scheduler.handle(RatesMeasured(0.0, m, (10.0,)))])
    old = dict(driver.threads)
    assert [thread.nodes for thread in old.values()] == [{0}, {0}]
    driver._handle(HostGone(old[0], HostLost("198.51.100.2:4000", "EOFError")))
    new = [thread for flotilla, thread in driver.threads.items() if flotilla not in old]
    assert sorted(thread.members[0].group.name for thread in new) == ["a", "b"]
    assert all(thread.nodes == {1} for thread in new)
    for thread in old.values():
        driver._handle(ThreadEnded(thread, {}))
    assert {group: {slot.node for slot in slots} for group, slots in driver.assigned.items()} == {"a": {1}, "b": {1}}
    assert all(scheduler.groups[m].status == "running" for m in "ab") and not driver.broken


def test_a_hub_held_back_by_a_compiling_trainer_waits_as_long_as_it_compiles_then_as_any_other():
    """SplitWatch (the flotilla's watchdog) on a stand-in flotilla and clock: a trainer that holds every
    buffer of its ring in a step that compiles (trainer.compile) keeps its hub from failing however long
    it takes, and is named once (whatever rings it holds); once it is done compiling, the same wait fails
    timeouts.stall_s after it was last seen compiling, naming the trainer. A compile counted as a hang, or a
    compile that excuses the wait for ever, fails."""
    from pipeline.orchestration.agent import Laggard
    from pipeline.orchestration.watch import SplitWatch
    from pipeline.runtime.hang import HangError, Patience

    now, compiling, said = [0.0], [True], []
    flotilla = SimpleNamespace(id=0, waiting={}, plan=SimpleNamespace(hubs=[SimpleNamespace(rank=0, node=0)]),
                               laggards=lambda: [Laggard(0, sink, "trainer-g-0", 42, "running", 4,  # a ring each
                                                         "at step 1 of 16 of epoch 1", compiling[0])
                                                 for sink in ("main", "alt")])
    watch = SplitWatch(flotilla, Patience(warn_s=60, stall_s=600), said.append)
    watch.stalls[0].clock = lambda: now[0]
    watch.stalls[0].moved()
    for now[0] in range(0, 3000, 30):
        watch.check()
    assert said == ["[yellow]waiting[/] hub 0 (node 0): trainer trainer-g-0 compiling (trainer.compile)"]
    compiling[0] = False
    with pytest.raises(HangError, match=r"trainer trainer-g-0 .* holds all 4 buffers .*timeouts.stall_s=600"):
        for now[0] in range(3000, 3700, 30):
            watch.check()
    assert now[0] == 2940 + 600  # stall_s after the last look that saw it compiling


def test_checkpoints_of_groups_that_stay_are_not_awaited_and_none_is_asked_for_twice():
    """EpochBoundary.save on a stand-in flotilla whose trainers write a checkpoint only when told to: a leaving
    group's checkpoint is awaited; one of a group that trains on is asked for and left to come later; asked
    for again (a stop, a new layout), it is awaited, not asked for twice. Fails if a staying group's
    checkpoint holds the boundary (the first call would wait past its deadline and raise), if one is
    written twice, or if a stop does not wait for one asked for earlier."""
    from pipeline.orchestration.driver import EpochBoundary
    from pipeline.runtime.hang import HangError
    from pipeline.training.reports import CheckpointSaved

    class Trainers:  # of the flotilla: they write what `written` says they wrote, each reported once
        def __init__(self):
            self.asked, self.written = [], []
            self.members = {"staying": None, "leaving": None}

        def save(self, group, models, epochs):
            self.asked.append((group, models, epochs))

        def failed_members(self):
            return {}

        def poll(self, timeout=None):
            reports, self.written = [CheckpointSaved(*saved) for saved in self.written], []
            return reports

    flotilla = Trainers()
    asked = flotilla.asked
    thread = SimpleNamespace(run_ctx=SimpleNamespace(report_s=1.0), flotilla_id=0, members=[],
                             check_stop=lambda: None)
    boundary = EpochBoundary(thread)
    flotilla.written.append(("leaving", "b", 1))
    assert boundary.save(flotilla, {("staying", "a"): 1, ("leaving", "b"): 1}, time.monotonic() + 1.0,
                         awaited={"leaving"}) == {"leaving"}
    assert asked == [("staying", ("a",), 1), ("leaving", ("b",), 1)]
    assert boundary.saved == {"b": 1}  # a's is still being written
    del flotilla.members["leaving"]  # as the boundary then removes it
    flotilla.written.append(("staying", "a", 1))
    assert boundary.save(flotilla, {("staying", "a"): 1}, time.monotonic() + 1.0) == {"staying"}
    assert asked == [("staying", ("a",), 1), ("leaving", ("b",), 1)] and boundary.saved == {"b": 1, "a": 1}
    # A stop waits for what was asked of a group that trains on, though it is not wanted again (a member
    # released from it, whose final checkpoint is being written)
    boundary.save(flotilla, {("staying", "c"): 2}, time.monotonic() + 1.0, awaited={"leaving"})
    with pytest.raises(HangError, match=r"checkpoints of \['c'\] not written"):
        boundary.save(flotilla, {}, time.monotonic() + 0.5)
    flotilla.written.append(("staying", "c", 2))
    assert boundary.save(flotilla, {}, time.monotonic() + 1.0) == {"staying"}


def test_members_resumed_earlier_than_asked_are_told_and_their_checkpoints_counted_from_there():
    """A trainer that found no checkpoint after the epochs its group was started at (one died before writing
    it) resumes from an earlier one and says so: the run's console names the models and both counts, and the
    boundary counts their newest checkpoint from there (so a stop asks for the epochs they train again)."""
    from pipeline.orchestration.driver import EpochBoundary
    from pipeline.training.reports import ResumedEarlier

    said = []
    group = SimpleNamespace(members=[SimpleNamespace(name="a"), SimpleNamespace(name="b")])
    thread = SimpleNamespace(run_ctx=SimpleNamespace(progress=SimpleNamespace(console=SimpleNamespace(
        print=said.append))), flotilla_id=3, members=[SimpleNamespace(group=group, start_epoch=2)])
    boundary = EpochBoundary(thread)
    assert boundary.saved == {"a": 2, "b": 2}
    assert boundary.forward([ResumedEarlier("g", ("a", "b"), 2, 1)]) == []
    assert boundary.saved == {"a": 1, "b": 1}
    assert said == ["flotilla 3: no checkpoint of a, b (group g) after 2 epochs (its trainer died before writing "
                    "it); they resume after 1, and train the epochs between again"]


def test_a_trainer_that_exited_cleanly_is_awaited_for_its_last_report_and_a_dead_one_is_not():
    """await_done after STOP, on a flotilla (its own failed_members and poll) whose node has one trainer that
    exited with code 0 before the driver read its TrainerDone (the last message a trainer sends, before it
    exits), and one killed (SIGKILL) that never will: the first one's checksums are read and kept, the dead
    one is not waited for and is named failed. Counting a clean exit as a failure ended the wait before the
    report was read, and a trainer's checksums were lost (test_topology's `received`, 3 of 4, in CI)."""
    from pipeline.orchestration.driver import EpochBoundary
    from pipeline.orchestration.flotilla import Flotilla
    from pipeline.training.reports import TrainerDone

    done = TrainerDone("clean", 0, {"main": [(1, 0, 0, 0, 7)]})

    class Node:  # its report arrives on the second poll, after the trainer's exit code
        def __init__(self):
            self.polls = 0

        def trainer_exit_codes(self):
            return {"clean": [("trainer-clean-0", 0)], "killed": [("trainer-killed-0", -9)]}

        def poll(self, timeout):
            self.polls += 1
            return [done] if self.polls == 2 else []

    group = SimpleNamespace(describe=lambda: "a model")
    flotilla = SimpleNamespace(members={name: SimpleNamespace(devices=["cpu"], group=group)
                                        for name in ("clean", "killed")},
                               errors={}, nodes={0: Node()}, plan=SimpleNamespace(hubs={}), summaries={},
                               hub_progress=lambda timeout: [], join=lambda timeout: None)
    flotilla.failed_members = lambda: Flotilla.failed_members(flotilla)
    flotilla.poll = lambda timeout=None: Flotilla.poll(flotilla, timeout)
    kept = []
    recorder = SimpleNamespace(add_checksums=lambda flotilla_id, report: kept.append(report))
    run = SimpleNamespace(report_s=5.0, delivery=SimpleNamespace(exit_s=1.0), recorder=recorder)
    boundary = EpochBoundary(SimpleNamespace(run_ctx=run, flotilla_id=0, members=[], check_stop=lambda: None))
    boundary.await_done(flotilla)
    assert kept == [done]
    assert list(flotilla.failed_members()) == ["killed"]
    assert "trainer-killed-0 (training a model) was killed (SIGKILL)" in flotilla.failed_members()["killed"]


def test_the_models_of_a_group_given_up_are_listed_by_name_but_not_one_that_had_converged(tmp_path, monkeypatch):
    """A packed group (a, b, c) fails more than max_failures times (0 here) after b converged and left it: a
    and c are given up (results.json `given_up`, exit code 3's line), by model as the docs promise; d trains
    on. The list named the slot group ("g0"), which is no model of the run."""
    from pipeline.scheduler import TrainerFailed

    driver = driver_of([GroupSpec("g0", (spec("a"), spec("b"), spec("c"))), GroupSpec("d", (spec("d"),))],
                       tmp_path, monkeypatch)
    driver.scheduler.max_failures = 0
    driver.converged.add("b")
    driver.scheduler.handle(TrainerFailed(1.0, "g0", driver.assigned["g0"][0]))
    assert driver.given_up == ["a", "c"]


def test_a_gain_of_exactly_min_delta_counts_whatever_the_floats():
    """Patience 1, min_delta 0.005 (one image of 200): 0.80 -> 0.805 and 0.81 -> 0.815 are both such a gain.
    In floating point 0.815 - 0.81 falls short of 0.005, and that model stopped where the other went on."""
    rule = Convergence(12, None, 1, 0.005)
    assert rule.reason([0.80, 0.805]) is None and rule.reason([0.81, 0.815]) is None
    assert rule.reason([0.81, 0.814]) == "no gain of 0.5% in 1 epochs"
