"""The driver's main thread, with stand-in flotilla threads: what it tells a flotilla after a round,
in which order; and the scheduler's state it saves, which a resumed run continues from."""
import io
import queue

import numpy as np
import pytest
from rich.console import Console

import pipeline.orchestration.driver as driver_module
from pipeline.measure.recorder import RunRecorder
from pipeline.orchestration.driver import (Continue, Convergence, Driver, EpochDone, ReleaseModel, RunContext,
                                           SaveCheckpoints, StopMember)
from pipeline.scheduler import Checkpoint, Cluster, FleetG, FormFlotilla, RatesMeasured, Scheduler, Slot, Start
from pipeline.training.group import GroupSpec
from tests.conftest import member
from pipeline.training.reports import ValReport

LABELS = np.array([0, 1])


class StandIn:
    """A flotilla thread that only takes the main thread's commands."""

    def __init__(self, flotilla_id, members, run, events, first_epoch=0):
        self.flotilla_id, self.members = flotilla_id, members
        self.commands: queue.Queue = queue.Queue()

    def start(self):
        pass

    def taken(self) -> list:
        return [self.commands.get_nowait() for _ in range(self.commands.qsize())]


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
    context = RunContext(None, None, None, recorder, None, 60.0, 10.0, tmp_path / "state")
    slots = {Slot(0, i): "cpu" for i in range(len(groups))}
    driver = Driver(scheduler, {g.name: g for g in groups}, slots, Convergence(epochs, None, 0, 0.005), context,
                    Console(file=io.StringIO()))
    decisions = [d for g in groups for d in scheduler.handle(RatesMeasured(0.0, g.name, (10.0,)))]
    driver._apply_decisions(decisions)
    return driver


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
    assert [(d.model, d.resume_epoch) for d in decisions if isinstance(d, Start)] == [("a", 2), ("b", 2)]
    assert again.now() >= driver.now() - 1 and again.log[:len(driver.log)] == driver.log
    assert again.run_ctx.recorder.accuracies("a") == [0.5, 0.5, 0.5]
    again._apply_decisions(decisions)  # joining again after 2 epochs forgets epoch 3: it is done again
    assert again.run_ctx.recorder.accuracies("a") == [0.5, 0.5]
    assert not any(isinstance(d, Checkpoint) for d in decisions)


def test_a_checkpoint_beyond_what_a_model_did_is_refused():
    scheduler = Scheduler(["a"], Cluster(1, 1), FleetG())
    scheduler.handle(RatesMeasured(0.0, "a", (10.0,)))
    with pytest.raises(ValueError, match="a checkpoint after 1 epochs, but it has done 0"):
        scheduler.checkpointed("a", 1)
