"""The trainer process's parts, in this process: checkpoints and resume of every member of a group, the
device feed's hand-back of ring buffers, and steps that never wait for the device."""
import concurrent.futures
import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.training.group import GroupSpec, GroupStep, Precision, StepInHand, to_host
from pipeline.training.members import ModelSpec, build_module
from pipeline.training.reports import CheckpointSaved, ResumedEarlier
from pipeline.training.trainer import (DeviceFeed, ReleaseMember, SaveCheckpoint, Trainer, TrainerSpec,
                                       TrainingSetup, saved_epochs)
from tests.conftest import member
from tests.test_members import declared


def model(name, width=8, lr=0.1):
    return member(name, width=width, lr=lr)


def trainer_spec(group, tmp_path, start=0, precision=Precision.fp32, compile=False):
    setup = TrainingSetup(num_classes=3, total_steps=40, steps_per_epoch=10, threads=1, precision=precision,
                          cuda_graphs=False, compile=compile, checkpoint_dir=tmp_path, record_checksums=False,
                          consume_only=False, collective_s=60)
    return TrainerSpec(setup=setup, group=group, image_sizes={"main": 32}, start_epoch=start, rank=0,
                       rendezvous="", device="cpu")


def batch(seed=0, count=8, side=32):
    random = np.random.default_rng(seed)
    return (random.integers(0, 256, (count, side, side, 3), dtype=np.uint8),
            random.integers(0, 3, count).astype(np.int64))


class Pipe:
    """The driver's end of a trainer's command pipe, as the trainer sees it."""

    def __init__(self):
        self.sent, self.received = [], []

    def poll(self):
        return bool(self.sent)

    def recv(self):
        self.received.append(self.sent.pop(0))
        return self.received[-1]


class Reports(list):
    """The driver's end of a trainer's report pipe: what the trainer sent, in order."""

    def send(self, report) -> None:
        self.append(report)


def drain(reports: Reports) -> list:
    taken = list(reports)
    reports.clear()
    return taken


@pytest.mark.parametrize("array_size", [1, 2])
def test_every_member_resumes_from_its_checkpoint_which_loads_as_a_plain_model(tmp_path, array_size):
    """The state kept after an epoch is what a later SaveCheckpoint writes, even after more steps."""
    group = GroupSpec("g", (model("a", lr=0.1), model("b", lr=0.02), model("c", width=4)), array_size)
    pipe, reports = Pipe(), Reports()
    first = Trainer(trainer_spec(group, tmp_path), reports, pipe)
    images, labels = batch()
    train = lambda: first.step.train({"main": (first.step.normalise(images), torch.from_numpy(labels))})
    train()
    first._keep_states({name: 0.5 for name in first.members})  # the end of epoch 1
    x = first.step.normalise(batch(1)[0])
    before = first.step.predict({"main": x})
    lrs = lambda trainer: [[float(g["lr"]) for g in unit.optimizer.param_groups] for unit in trainer.step.units]
    lrs_then = lrs(first)
    train()  # epoch 2 goes on before the driver's command comes
    pipe.sent.append(SaveCheckpoint(("a", "b", "c"), 1))
    first._obey()  # the writer thread writes them
    first.written(wait=True)
    assert drain(reports) == [CheckpointSaved("g", name, 1) for name in "abc"]
    resumed = Trainer(trainer_spec(group, tmp_path, start=1), Reports())
    assert resumed.epoch == 1
    after = resumed.step.predict({"main": x})
    for name in "abc":
        assert torch.allclose(before[name], after[name], atol=1e-6), name
        saved = torch.load(tmp_path / name / "epoch1.pt", weights_only=True)
        plain = build_module(ModelSpec(**saved["member"]), 3, 32)  # what its declaration builds
        plain.load_state_dict(saved["model"])  # strict: a member's checkpoint is a plain model's
        plain.eval()
        with torch.no_grad():
            assert torch.allclose(torch.softmax(plain(x), 1), after[name], atol=1e-5), name
        assert saved["lr_scheduler"]["last_epoch"] == 1
    # The learning rates go on from where they were at epoch 1's end, each member's own.
    assert lrs(resumed) == lrs_then != lrs(first)
    # A trainer that died while writing epoch 2's checkpoint: the members resume from epoch 1's, and the
    # driver is told (a child's print could fail its trainer: its stdout may be a pipe whose reader has gone).
    for folder, asked, epochs in ((tmp_path, 2, 1), (tmp_path / "none written", 1, 0)):
        told = Reports()
        assert Trainer(trainer_spec(group, folder, start=asked), told).epoch == epochs
        assert told == [ResumedEarlier("g", ("a", "b", "c"), asked, epochs)]
    assert resumed.reports == []  # as asked
    with pytest.raises(RuntimeError, match="keeps its state after \\[1\\]"):
        pipe.sent.append(SaveCheckpoint(("a",), 2))
        first._obey()


def test_a_trainer_lets_its_oldest_kept_copy_go_before_it_makes_the_next(tmp_path):
    """At each epoch's end a trainer keeps every member's state; it holds the last KEPT_EPOCHS epochs' (the
    memory check counts that many) and frees the oldest before it copies the new one, so no more are ever alive.
    The driver may ask for either kept epoch, not an older one. Dropping the oldest after the copy, or not at
    all, fails."""
    import gc
    import weakref

    from pipeline.training.trainer import KEPT_EPOCHS

    group = GroupSpec("g", (model("a"), model("b")))
    pipe = Pipe()
    trainer = Trainer(trainer_spec(group, tmp_path), Reports(), pipe)
    copies, alive = weakref.WeakSet(), []
    make = trainer.step.kept_states

    def kept_states():
        gc.collect()
        alive.append(len(copies))  # the copies still held as the next is made
        copies.add(kept := make())
        return kept

    trainer.step.kept_states = kept_states
    for epoch in range(4):
        trainer.epoch = epoch
        trainer._keep_states({"a": 0.5, "b": 0.5})
    assert KEPT_EPOCHS == 2 and alive == [0, 1, 1, 1]
    assert {name: sorted(epochs) for name, epochs in trainer.finished.items()} == {"a": [3, 4], "b": [3, 4]}
    pipe.sent.append(SaveCheckpoint(("a", "b"), 3))
    trainer._obey()
    trainer.written(wait=True)
    assert saved_epochs(tmp_path, "a") == saved_epochs(tmp_path, "b") == [3]
    with pytest.raises(RuntimeError, match="after 2 epochs, but this trainer keeps its state after \\[3, 4\\]"):
        pipe.sent.append(SaveCheckpoint(("a",), 2))
        trainer._obey()


def test_kept_states_of_every_kind_of_unit_are_their_state_then_in_host_memory_of_their_own():
    """GroupStep.kept_states on CPU, over an HFTA array, a model alone and a vmap array (AdamW members): after
    more steps each member's checkpoint is its state when kept (weights, optimiser state, rates), each tensor
    its own memory (a vmap member's weights not a view of the array's rows). Mistakes it catches: a copy
    sharing the live tensors, one unit's members mixed up, a view that would save every member's rows."""
    adamw = {"_target_": "torch.optim.AdamW", "lr": 0.01, "weight_decay": 0.01}
    members = (model("a"), model("b", lr=0.02), model("c", width=4),
               *(declared(name, optimizer=adamw, seed=seed) for seed, name in enumerate("de")))
    step = GroupStep(GroupSpec("g", members, array_size=2), 3, {"main": 32}, torch.device("cpu"), 10)
    assert [type(unit).__name__ for unit in step.units] == ["_Array", "_Solo", "_Stacked"]
    images, labels = batch()
    train = lambda: step.train({"main": (step.normalise(images), torch.from_numpy(labels))})
    train()
    then = {name: to_host(step.state(name)) for name in step.names}  # (a model alone's state is its live tensors)
    kept = step.kept_states()
    train()
    kept.to_host()  # (nothing to do on CPU)
    assert kept.names == ["a", "b", "c", "d", "e"]
    for name in step.names:
        state, now = kept.member(name), step.state(name)
        tensors = lambda s: {**s["model"], **{f"{i}.{key}": t for i, buffers in s["optimizer"]["state"].items()
                                              for key, t in buffers.items() if t.dim()}}
        assert tensors(state).keys() == tensors(then[name]).keys() and len(tensors(state)) > len(state["model"])
        assert all(torch.equal(t, tensors(then[name])[key]) for key, t in tensors(state).items()), name
        assert not all(torch.equal(t, tensors(now)[key]) for key, t in tensors(state).items()), name  # trained on
        assert state["optimizer"]["param_groups"] == then[name]["optimizer"]["param_groups"], name
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in state["model"].values())


def test_pruning_keeps_the_newest_checkpoints_and_the_best(tmp_path):
    pipe = Pipe()
    trainer = Trainer(trainer_spec(GroupSpec("g", (model("a"),), 1), tmp_path), Reports(), pipe)
    for epochs, accuracy in enumerate([0.5, 0.9, 0.6, 0.9, 0.7], start=1):
        trainer.epoch = epochs - 1  # the end of that epoch
        trainer._keep_states({"a": accuracy})
        pipe.sent.append(SaveCheckpoint(("a",), epochs))
        trainer._obey()
        trainer.written(wait=True)
    assert saved_epochs(tmp_path, "a") == [2, 4, 5]  # the best (the first of equals) and the newest two
    assert json.loads((tmp_path / "a" / "best.json").read_text()) == {"epochs": 2, "val_accuracy": 0.9}


def test_a_checkpoint_that_fails_to_be_written_fails_the_trainer_at_its_next_command(tmp_path, monkeypatch):
    """The writer thread's error is raised in the training loop, where a trainer's failures are reported;
    the loop went on meanwhile. Fails if the writer's error is lost."""
    def full_disk(state, file):
        raise OSError(28, "No space left on device")

    pipe = Pipe()
    trainer = Trainer(trainer_spec(GroupSpec("g", (model("a"),), 1), tmp_path), Reports(), pipe)
    trainer._keep_states({"a": 0.5})
    monkeypatch.setattr(torch, "save", full_disk)
    pipe.sent.append(SaveCheckpoint(("a",), 1))
    trainer._obey()  # queued: the loop goes on
    concurrent.futures.wait(trainer.writing)
    with pytest.raises(OSError, match="No space left on device"):
        trainer._obey()
    assert not (tmp_path / "a" / "epoch1.pt").exists()


def test_a_failing_trainer_writes_the_checkpoints_asked_for_before_it_reports_its_failure(tmp_path, monkeypatch):
    """trainer_main, its loop failing while a checkpoint it was asked for is being written: the checkpoint is
    written and CheckpointSaved sent before TrainerError (told of the failure, the driver stops the trainer).
    The write waits until the failing trainer waits for it (10 s at most): a trainer that reported at once
    would send TrainerError first, and this fails."""
    from pipeline.training import trainer as trainer_module
    from pipeline.training.reports import TrainerError

    failing = []
    waiting_for_writes = threading.Event()
    real_wait, real_save = concurrent.futures.wait, torch.save

    def wait(futures, *args, **kwargs):
        if futures:  # (the loop's own wait before a write is queued has none)
            waiting_for_writes.set()
        return real_wait(futures, *args, **kwargs)

    def save_once_the_trainer_waits(state, file):
        waiting_for_writes.wait(timeout=10)
        real_save(state, file)

    def consume(self, readers):  # the loop: an epoch kept, its checkpoint asked for and queued, then a failure
        failing.append(self)
        self._keep_states({"a": 0.5})
        self.commands.sent.append(SaveCheckpoint(("a",), 1))
        self._obey()
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(concurrent.futures, "wait", wait)
    monkeypatch.setattr(torch, "save", save_once_the_trainer_waits)
    monkeypatch.setattr(trainer_module, "child_started", lambda role: None)  # (what a child process sets up)
    monkeypatch.setattr(Trainer, "consume", consume)
    reports = Reports()
    with pytest.raises(SystemExit):
        trainer_module.trainer_main(trainer_spec(GroupSpec("g", (model("a"),), 1), tmp_path), {}, None,
                                    to_parent=reports, from_parent=Pipe())
    real_wait(failing[0].writing)
    assert [type(r) for r in reports] == [CheckpointSaved, TrainerError], reports
    assert "the device fell over" in reports[1].traceback and saved_epochs(tmp_path, "a") == [1]


def test_a_released_member_leaves_and_the_others_train_on_unchanged(tmp_path):
    """The command pipe: a member released between batches is gone before the next one; the others'
    weights then match a group that never had it."""
    members = (model("a"), model("b", lr=0.02), model("c", lr=0.05))
    images, labels = batch()
    inputs = lambda trainer: {"main": (trainer.step.normalise(images), torch.from_numpy(labels))}
    pipe = Pipe()
    trainer = Trainer(trainer_spec(GroupSpec("g", members, 3), tmp_path), Reports(), pipe)
    without = Trainer(trainer_spec(GroupSpec("g", (members[0], members[2]), 2), tmp_path), Reports())
    for t in (trainer, without):
        t.step.train(inputs(t))
    pipe.sent.append(ReleaseMember("b"))
    trainer._obey()
    assert trainer.members == ["a", "c"] and trainer.step.names == ["a", "c"] and not pipe.sent
    for t in (trainer, without):
        t.step.train(inputs(t))
    x = trainer.step.normalise(batch(2)[0])
    left, never = trainer.step.predict({"main": x}), without.step.predict({"main": x})
    assert set(left) == {"a", "c"}
    for name in "ac":
        assert torch.allclose(left[name], never[name], atol=1e-5), name


@pytest.mark.slow
def test_a_compiled_group_trains_as_the_eager_one_and_reports_the_seconds_it_compiled(tmp_path):
    """trainer.compile on CPU (inductor): every kind of unit (an HFTA array, a vmap array, a model alone)
    compiled, trains and validates to the eager group's weights and softmax over 3 steps, and checkpoints
    as a plain module (no compiled wrapper's names). The first step of each batch shape and split is what
    it reports as compiling; an eager group reports none. Compiling ignored, or a wrapper's names in the
    state, fails. (One batch shape: each more costs CI 45 s of compiling.)"""
    from torch._dynamo.utils import counters

    adamw = {"_target_": "torch.optim.AdamW", "lr": 0.01, "weight_decay": 0.01}
    vmapped = [declared(name, optimizer=adamw, seed=seed) for seed, name in enumerate("de")]
    alone = declared("c", model={"_target_": "tests.test_members.SmallNet", "channels": 8})
    members = (model("a", width=4), model("b", width=4, lr=0.05), alone, *vmapped)
    group = GroupSpec("g", members, array_size=2)
    trainers = {compiled: Trainer(trainer_spec(group, tmp_path, compile=compiled), Reports())
                for compiled in (False, True)}
    assert [type(unit).__name__ for unit in trainers[True].step.units] == ["_Array", "_Solo", "_Stacked"]
    graphs = counters["stats"]["unique_graphs"]
    for trainer in trainers.values():
        for seed in range(3):
            images, labels = batch(seed)
            trainer.step.train({"main": (trainer.step.normalise(images), torch.from_numpy(labels))})
        trainer.seen = 24  # its images, as _train_step counts them
        trainer._report_train()
    assert counters["stats"]["unique_graphs"] - graphs >= 3  # a training graph of each unit at least
    x = {"main": trainers[False].step.normalise(batch(3)[0])}
    eager, compiled = (trainers[c].step.predict(x) for c in (False, True))
    for spec in members:
        mine, theirs = trainers[True].step.state(spec.name), trainers[False].step.state(spec.name)
        assert mine["model"].keys() == theirs["model"].keys()
        for key, tensor in theirs["model"].items():
            torch.testing.assert_close(mine["model"][key], tensor, rtol=1e-3, atol=1e-4, msg=f"{spec.name} {key}")
        torch.testing.assert_close(compiled[spec.name], eager[spec.name], rtol=1e-3, atol=1e-4)
    reported = {c: [r.compile_s for r in trainers[c].reports] for c in (False, True)}
    assert reported[False] == [0.0] * 5 and len(set(reported[True])) == 1 and reported[True][0] > 0
    assert trainers[True].step.compiled == {("train", (("main", (8, 3, 32, 32)),)),
                                            ("validate", (("main", (8, 3, 32, 32)),))}


def test_a_trainer_shows_its_parent_its_step_and_the_members_inside_theirs(tmp_path):
    """What the driver names when a trainer hangs (StepInHand, read from shared memory): the epoch and
    step it has begun and which members are inside their step, a fused array's all at once. Planted
    mistakes it catches: a step not counted, a unit not marked, a mark left after the step."""
    group = GroupSpec("g", (model("a", width=4), model("b"), model("c")), array_size=2)  # units: a; b and c fused
    in_hand = StepInHand(mp.get_context("spawn"), group, steps=10)
    trainer = Trainer(trainer_spec(group, tmp_path), Reports(), Pipe(), in_hand)
    seen = []
    for unit in trainer.step.units:
        unit.losses = lambda x, y, losses=unit.losses: (seen.append(in_hand.describe()), losses(x, y))[1]
    images, labels = batch()
    message = lambda: SimpleNamespace(images=images, labels=labels, release=lambda: None)
    assert in_hand.describe() == "before its first step"
    trainer.epoch = 2
    trainer._train_step({"main": message()})
    trainer._train_step({"main": message()})
    assert seen == [f"at step {step} of 10 of epoch 3, in the step of {names}"
                    for step in (1, 2) for names in ("a", "b, c")]
    assert in_hand.describe() == "at step 2 of 10 of epoch 3, between members' steps"


class FakeEvent:
    """A copy-done marker the test completes by hand."""

    made = []

    def __init__(self):
        self.done = False
        FakeEvent.made.append(self)

    def record(self):
        pass

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_a_ring_buffer_goes_back_only_once_its_copy_has_finished():
    FakeEvent.made.clear()
    released = []
    feed = DeviceFeed(torch.device("cpu"), new_event=FakeEvent)
    images, labels = batch()
    x, y = feed.copy("main", images, labels, lambda: released.append(1))
    assert torch.equal(x, torch.from_numpy(images)) and torch.equal(y, torch.from_numpy(labels))
    feed.copy("main", images, labels, lambda: released.append(2))
    assert released == []  # neither copy has finished
    FakeEvent.made[0].done = True
    feed.copy("main", images, labels, lambda: released.append(3))
    assert released == [1]  # the first, and only it, at the next batch
    feed.flush()  # the end of a split waits for every copy
    assert released == [1, 2, 3]


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16, Precision.fp16])
@pytest.mark.parametrize("array_size, threads", [(1, 1), (2, 1), (1, 2)])  # (1, 2): units step side by side
def test_a_training_step_never_waits_for_the_device(monkeypatch, precision, array_size, threads):
    """No host synchronisation inside a step: every way a tensor's value reaches Python is counted
    (item, float, bool, tolist, numpy, cpu, cuda.synchronize) and none may happen, but for fp16's one
    per unit: its gradient scaler reads whether the unit's gradients overflowed, to skip that step (an
    optimiser that takes the scaler's flag on the device, as torch's fused ones do, would not need it).
    A loss read, or a scaler shared by the units, fails."""
    group = GroupSpec("g", (model("a"), model("b", lr=0.02), model("w", width=4)), array_size)
    step = GroupStep(group, 3, {"main": 32}, torch.device("cpu"), 10, precision=precision, threads=threads)
    assert (step.pool is not None) == (threads > 1)
    images, labels = batch()
    inputs = {"main": (step.normalise(images), torch.from_numpy(labels))}
    step.train(inputs)  # the first step builds the optimisers' state: counted too, in the next
    syncs = []
    for name in ("item", "__float__", "__bool__", "tolist", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (syncs.append(_n),
                                                                                           _o(self, *a, **k))[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append("cuda.synchronize"))
    losses = step.train(inputs)
    assert syncs == (["item"] * len(step.units) if precision == Precision.fp16 else [])
    syncs.clear()
    assert set(losses) == {"a", "b", "w"} and all(loss.dim() == 0 for loss in losses.values())
    float(losses["a"])  # reading a loss is a synchronisation: the count sees it
    assert syncs == ["__float__"]
    monkeypatch.undo()
    assert all(np.isfinite(float(loss)) for loss in losses.values())


# ResNets two and four channels wide: their 1x1 stride-2 shortcuts go from 2 to 4 and 4 to 8 channels, the
# shapes whose channels-last backward in oneDNN's AVX2 kernels hangs or corrupts the heap (issue 29).
NARROW_STEPS = """
import numpy as np, torch
from pipeline.training.group import GroupSpec, GroupStep
from tests.conftest import member
from tests.test_members import declared
members = tuple(member(f"w{w}", width=w) for w in (2, 4))
step = GroupStep(GroupSpec("narrow", members), 3, {"main": 16}, "cpu", 200)
images = np.random.default_rng(0).integers(0, 256, (8, 16, 16, 3), dtype=np.uint8)
inputs = {"main": (step.normalise(images), torch.zeros(8, dtype=torch.long))}
for _ in range(200):
    losses = step.train(inputs)
print(all(map(torch.isfinite, losses.values())))
"""


def test_narrow_convolutions_train_through_the_group_step_on_cpu():
    """The trainer's own step on the shapes that met oneDNN's channels-last bug finishes, in a process of
    its own (a hang or a crash there fails this test, not the suite). The mistake it catches: CPU slots
    training channels_last (training_memory_format), which hangs here under the suite's ONEDNN_MAX_CPU_ISA=AVX2
    (tests/conftest.py), on any x86 CPU."""
    try:
        done = subprocess.run([sys.executable, "-c", NARROW_STEPS], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("200 steps of two narrow ResNets did not finish in 120 s (a hang in a convolution kernel?)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True"]


def onednn_conv(**environment) -> tuple[str, list[str]]:
    """The ISA oneDNN says it uses, and its kernels' names, for one convolution in a fresh process."""
    code = "import torch; torch.nn.Conv2d(8, 8, 3)(torch.randn(2, 8, 8, 8))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ONEDNN_VERBOSE": "1", **environment})
    assert done.returncode == 0, done.stderr[-3000:]
    isa = [line for line in done.stdout.splitlines() if line.startswith("onednn_verbose,v1,info,cpu,isa:")]
    kernels = [line.split(",")[6] for line in done.stdout.splitlines() if ",exec,cpu,convolution," in line]
    assert len(isa) == 1 and kernels, done.stdout[-3000:]
    return isa[0], kernels


def test_the_suite_runs_onednn_at_most_avx2_whatever_the_cpu():
    """What CI meets is what AVX2-only CPUs meet: tests/conftest.py holds oneDNN to its AVX2 kernels, and
    the torch build honours such a cap (held to AVX, every machine here runs AVX kernels). The mistakes it
    catches: a torch build that ignores the cap, on any machine; the cap gone from conftest, on an AVX-512
    machine (on an AVX2-only one the suite's own line cannot tell)."""
    isa, kernels = onednn_conv()
    assert isa.endswith(("Intel AVX2", "Intel AVX", "Intel SSE4.1")), isa  # the most oneDNN uses
    assert not any("avx512" in kernel or "amx" in kernel for kernel in kernels), kernels
    isa, kernels = onednn_conv(ONEDNN_MAX_CPU_ISA="AVX")
    assert isa.endswith("Intel AVX") and all(not kernel.endswith(":avx2") for kernel in kernels), (isa, kernels)


def test_a_step_graph_steps_eagerly_then_captures_once_per_shape_and_replays(monkeypatch):
    """StepGraph's schedule, with torch's graph API faked (CI has no GPU; tests/test_gpu.py runs the real
    one): EAGER_STEPS eager steps, then one capture (the step recorded, inside the capture), then replays
    only; an epoch's last, smaller batch is stepped eagerly once, then captured and replayed too; each
    replay hands out a new copy of the captured losses. StaticInputs keeps a pair per stream and shape, up
    to SHAPES. A capture that fails names the unit's members and trainer.cuda_graphs. Planted mistakes it
    catches: capturing at once (before cuDNN and the optimiser are warm), capturing again at every step,
    a graph replayed on a batch of another shape, handing out the graph's own loss tensor, a capture in CUDA's
    global mode (which the checkpoint writer's copies would break)."""
    from pipeline.training.graphs import EAGER_STEPS, SHAPES, StaticInputs, StepGraph, shape_of, stage

    events = []

    class Graph:
        def replay(self):
            events.append("replay")

    captured_on = []

    @contextlib.contextmanager
    def capturing(graph, pool, stream, capture_error_mode):
        events.append("capture")
        captured_on.append((stream, capture_error_mode))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    outputs = []  # what the step returned, eager or inside a capture: the batch's size, so a shape's own

    def step(x, y):
        events.append("step")
        outputs.append(torch.tensor([float(len(x))]))
        return outputs[-1]

    graph = StepGraph(step, pool=None, names=("a", "b"), stream="its unit's stream")
    full, last = (torch.zeros(4, 2), torch.zeros(4)), (torch.zeros(3, 2), torch.zeros(3))
    losses = [graph(*batch) for batch in [full] * (EAGER_STEPS + 1) + [last, full, last, last, full]]
    assert events == (["step"] * EAGER_STEPS + ["capture", "step", "replay"]  # the epoch's batches
                      + ["step", "replay", "capture", "step", "replay", "replay", "replay"])  # its last one
    assert graph.captured == [shape_of(*full), shape_of(*last)]
    # each capture on its unit's stream (cuBLAS's workspace), letting the checkpoint writer's thread copy meanwhile
    assert captured_on == [("its unit's stream", "thread_local")] * 2
    assert [loss.item() for loss in losses] == [4.0] * (EAGER_STEPS + 1) + [3.0, 4.0, 3.0, 3.0, 4.0]  # its graph
    replayed = [losses[i] for i in (EAGER_STEPS, EAGER_STEPS + 2, EAGER_STEPS + 3, EAGER_STEPS + 4, EAGER_STEPS + 5)]
    assert all(loss is not output for loss in replayed for output in outputs)

    inputs, other = StaticInputs(), (torch.zeros(5, 2), torch.zeros(5))
    first = inputs.take("main", torch.ones(4, 2), torch.ones(4))
    again = inputs.take("main", torch.full((4, 2), 2.0), torch.ones(4))
    assert again[2] and again[0] is first[0] and first[0].eq(2).all()  # copied into the same pair
    assert SHAPES == 2  # the cases here are written for two
    assert inputs.take("main", *last)[2] and inputs.take("other", *other)[2]
    images, labels, staged = inputs.take("main", *other)  # a third shape of one stream steps eagerly
    assert images is other[0] and labels is other[1] and staged is False
    validation = StaticInputs()  # x alone
    x, staged = validation.take("main", torch.ones(4, 2))
    assert staged and validation.take("main", torch.zeros(4, 2))[0] is x and x.eq(0).all()
    ones = torch.ones(4, 2)
    assert stage(None, {"main": (ones,)}) == {"main": (ones, False)}  # without graphs: as it is
    (staged_x, staged), = stage(validation, {"main": (ones,)}).values()
    assert staged and staged_x is x and x.eq(1).all()

    @contextlib.contextmanager
    def failing(graph, pool, stream, capture_error_mode):
        yield
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", failing)
    broken = StepGraph(step, pool=None, names=("a", "b"))
    for _ in range(EAGER_STEPS):
        broken(*full)
    with pytest.raises(RuntimeError, match=r"step of a, b cannot be captured .*trainer\.cuda_graphs=false"):
        broken(*full)


def test_units_on_streams_fork_from_the_staging_stream_and_join_it_even_when_a_step_fails(monkeypatch):
    """GroupStep's CUDA streams with torch's stream API faked (CI has no GPU; tests/test_gpu.py trains on
    real ones): every stream waits for the current one before any unit steps, each unit steps inside its
    stream (dealt in turn), and the current stream waits for every stream after, a failing step included;
    as units leave, one moves only when a stream has two more than another. Planted mistakes it catches: a
    stream that starts before the staged batch is ready, losses read before their stream is done, a join
    skipped by an error."""
    events, active = [], ["current"]

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

    @contextlib.contextmanager
    def on(stream):
        active.append(stream.name)
        try:
            yield
        finally:
            active.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("current"))
    monkeypatch.setattr(torch.cuda, "stream", on)
    members = tuple(model(name, width=4 * (i + 1)) for i, name in enumerate("abcd"))  # no two fuse: 4 units
    step = GroupStep(GroupSpec("g", members, cuda_streams=2), 3, {"main": 16}, "cpu", 10)
    step.streams = [Stream("s0"), Stream("s1")]  # what a GPU's group of cuda_streams=2 starts with
    for unit in step.units:
        unit.stream = None
    step._deal_streams()
    stepping = step._train_unit

    def train_unit(unit, *batch):
        events.append(f"{unit.names[0]} on {active[-1]}")
        if unit.names[0] == "c" and failing:
            raise RuntimeError("the device fell over")
        return stepping(unit, *batch)

    monkeypatch.setattr(step, "_train_unit", train_unit)
    images, labels = batch(side=16)
    x, y = step.normalise(images), torch.from_numpy(labels)
    failing = False
    assert set(step.train({"main": (x, y)})) == set("abcd")
    assert events == ["s0 waits for current", "s1 waits for current", "a on s0", "b on s1", "c on s0", "d on s1",
                      "current waits for s0", "current waits for s1"]
    events.clear()
    failing = True
    with pytest.raises(RuntimeError, match="the device fell over"):
        step.train({"main": (x, y)})
    assert events[-3:] == ["c on s0", "current waits for s0", "current waits for s1"]
    events.clear()
    failing = False
    step.release("a")  # streams of 1 and 2 units: none moves
    step.train({"main": (x, y)})
    assert events[2:5] == ["b on s1", "c on s0", "d on s1"]
    events.clear()
    step.release("c")  # stream 0 empty, stream 1 with b and d: d moves
    step.train({"main": (x, y)})
    assert events[2:4] == ["b on s1", "d on s0"]


class Plain(torch.nn.Module):
    """No batch norm (whose statistics are each rank's own): DDP's ranks and one process compute one gradient."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                        torch.nn.Flatten(), torch.nn.Linear(4, num_classes))

    def forward(self, x):
        return self.body(x)


def _plain(slots: int) -> ModelSpec:
    from dataclasses import replace

    return replace(member("m", slots=slots), model={"_target_": "tests.test_trainer.Plain"},
                   optimizer={"_target_": "torch.optim.SGD", "lr": 0.5})


def _odd_batch():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(5, 3, 8, 8, generator=generator), torch.tensor([0, 1, 2, 0, 1])


def _on_two_ranks(target, *args, replies: int = 1) -> list:
    """`target(rank, address, *args, results)` in two spawned processes that meet at one address: the first
    `replies` things they put in `results`."""
    from pipeline.delivery.collective import LocalRendezvous

    context = mp.get_context("spawn")
    rendezvous, results = LocalRendezvous(), context.Queue()
    address = rendezvous.next()
    ranks = [context.Process(target=target, args=(rank, address, *args, results), daemon=True) for rank in (0, 1)]
    try:
        for process in ranks:
            process.start()
        return [results.get(timeout=120) for _ in range(replies)]
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
        rendezvous.close()


def _ddp_rank(rank: int, address: str, weighted: bool, results) -> None:
    """One rank of a model on 2 slots: one step on its rows of a batch of 5 (3 and 2), as the trainer
    weighs them (or not); rank 0 puts the weights it ends with."""
    from pipeline.training.group import join_process_group, rank_rows, shard_weight

    try:
        collectives = join_process_group(address, rank, 2, torch.device("cpu"), 60.0, "m")
        group = GroupStep(GroupSpec("m", (_plain(2),)), 3, {"main": 8}, "cpu", 10, world=2)
        x, y = _odd_batch()
        rows = rank_rows(rank, 2)
        weight = shard_weight(len(y[rows]), 2, len(y)) if weighted else 1.0
        with collectives():
            group.train({"main": (x[rows], y[rows])}, weight=weight)
        if rank == 0:
            results.put({key: tensor.numpy() for key, tensor in group.state("m")["model"].items()})
    except BaseException as err:
        results.put(repr(err))


@pytest.mark.slow
def test_a_data_parallel_step_on_an_uneven_batch_weighs_every_image_as_one_process_does():
    """A batch of 5 on 2 slots: rank 0 trains 3 rows, rank 1 two. Each rank's loss weighted by its rows
    over an even share, DDP's average of the ranks' gradients is one process's gradient on the 5: the
    weights after a step are the same. DDP's plain average weighed rank 1's images 1/4 each and rank 0's
    1/6 (and every batch of 64 on 3 slots so)."""
    alone = GroupStep(GroupSpec("m", (_plain(1),)), 3, {"main": 8}, "cpu", 10)
    alone.train({"main": _odd_batch()})
    expected = {key: tensor.numpy() for key, tensor in alone.state("m")["model"].items()}
    got = {}
    for weighted in (True, False):
        (got[weighted],) = _on_two_ranks(_ddp_rank, weighted)
        assert isinstance(got[weighted], dict), got[weighted]
    for key, tensor in expected.items():
        np.testing.assert_allclose(got[True][key], tensor, rtol=1e-5, atol=1e-6, err_msg=key)
    assert not all(np.allclose(got[False][key], tensor, rtol=1e-5, atol=1e-6) for key, tensor in expected.items())


def test_a_schedule_on_a_metric_steps_after_validation_before_the_epochs_state_is_kept(tmp_path):
    """A ReduceLROnPlateau member beside a cosine one, in one process: each validation steps its schedule on
    its loss, before the epoch's state is kept, so the checkpoint of the epoch whose loss did not improve
    holds the cut rate, which a trainer resumed from it trains at; the cosine member's rate is training's."""
    from dataclasses import replace

    plateau = {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "_partial_": True, "factor": 0.5,
               "patience": 0}
    group = GroupSpec("g", (replace(model("p"), lr_scheduler=plateau), model("c")))
    pipe, reports = Pipe(), Reports()
    trainer = Trainer(trainer_spec(group, tmp_path), reports, pipe)
    images, labels = batch()
    cosine_rates = []
    for right in (0.9, 0.4):  # the true class's probability: the loss rises in the second epoch
        trainer.step.train({"main": (trainer.step.normalise(images), torch.from_numpy(labels))})
        cosine_rates.append(trainer.step.rate("c"))
        probs = torch.full((8, 3), (1 - right) / 2)
        probs[torch.arange(8), torch.from_numpy(labels)] = right
        for name in trainer.members:
            trainer.val_probs[name] = [probs]
        trainer.val_labels["main"] = [torch.from_numpy(labels)]
        trainer._finish_validation()
        trainer.epoch += 1
    assert [type(r).__name__ for r in drain(reports)] == ["ValReport"] * 4
    assert trainer.step.rate("p") == pytest.approx(0.05)
    assert cosine_rates[0] < 0.1 and cosine_rates[1] < cosine_rates[0]  # stepped by training, not validation
    pipe.sent.append(SaveCheckpoint(("p", "c"), 2))
    trainer._obey()
    trainer.written(wait=True)
    saved = torch.load(tmp_path / "p" / "epoch2.pt", weights_only=True)
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.05)
    resumed = Trainer(trainer_spec(group, tmp_path, start=2), Reports())
    assert resumed.step.rate("p") == pytest.approx(0.05)
    assert resumed.step.rate("c") == pytest.approx(cosine_rates[1])
    trainer.writer.shutdown()
    resumed.writer.shutdown()


def _plateau_rank(rank: int, address: str, checkpoints, results) -> None:
    """One rank of a model on 2 slots whose schedule steps on its validation loss: two epochs' validation
    (rank 0's probabilities, the second epoch's worse); each rank puts its rate after each."""
    from dataclasses import replace

    try:
        plateau = {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "_partial_": True, "factor": 0.5,
                   "patience": 0}
        group = GroupSpec("m", (replace(_plain(2), lr_scheduler=plateau),))
        spec = replace(trainer_spec(group, checkpoints), rank=rank, rendezvous=address)
        trainer = Trainer(spec, Reports())
        labels = torch.tensor([0, 1, 2, 0])
        rates = []
        for right in (0.9, 0.4):  # the true class's probability: the loss rises in the second epoch
            if rank == 0:
                probs = torch.full((4, 3), (1 - right) / 2)
                probs[torch.arange(4), labels] = right
                trainer.val_probs["m"], trainer.val_labels["main"] = [probs], [labels]
            trainer._finish_validation()
            rates.append(trainer.step.rate("m"))
        trainer.writer.shutdown()
        results.put((rank, rates))
    except BaseException as err:
        results.put((rank, repr(err)))


@pytest.mark.slow
def test_a_data_parallel_models_schedule_on_a_metric_steps_alike_on_every_rank(tmp_path):
    """ReduceLROnPlateau on a model on 2 slots: only rank 0 validates, and every rank steps its schedule on
    rank 0's validation loss, so the ranks keep one rate (rank 1 stepping on no loss kept the first)."""
    got = dict(_on_two_ranks(_plateau_rank, tmp_path, replies=2))
    assert got == {0: [0.5, 0.25], 1: [0.5, 0.25]}
