"""The trainer process's parts, in this process: checkpoints and resume of every member of a group, the
device feed's hand-back of ring buffers, and steps that never wait for the device."""
import json
import queue

import numpy as np
import pytest
import torch

from pipeline.training.group import GroupSpec, GroupStep, ModelSpec, Precision, normalise
from pipeline.training.models import build_model
from pipeline.training.reports import CheckpointSaved
from pipeline.training.trainer import (DeviceFeed, ReleaseMember, SaveCheckpoint, Trainer, TrainerSpec,
                                       saved_epochs)


def model(name, width=8, lr=0.1):
    return ModelSpec(name, "resnet", 10, width, 12, lr, 0.9, 5e-4, 1, "main")


def trainer_spec(group, tmp_path, start=0, precision=Precision.fp32):
    return TrainerSpec(group, 3, {"main": 32}, 4, start, 10, 0, "", "cpu", 1, precision, str(tmp_path), False, False,
                       collective_s=60)


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


def drain(reports: queue.Queue) -> list:
    return [reports.get_nowait() for _ in range(reports.qsize())]


@pytest.mark.parametrize("array_size", [1, 2])
def test_every_member_resumes_from_its_checkpoint_which_loads_as_a_plain_model(tmp_path, array_size):
    """The state kept after an epoch is what a later SaveCheckpoint writes, even after more steps."""
    group = GroupSpec("g", (model("a", lr=0.1), model("b", lr=0.02), model("c", width=4)), array_size)
    pipe, reports = Pipe(), queue.Queue()
    first = Trainer(trainer_spec(group, tmp_path), reports, pipe)
    images, labels = batch()
    train = lambda: first.step.train({"main": (normalise(images, first.device), torch.from_numpy(labels))})
    train()
    for name in first.members:
        first._keep_state(name, accuracy=0.5)  # the end of epoch 1
    x = normalise(batch(1)[0], first.device)
    before = first.step.predict({"main": x})
    lrs = lambda trainer: [[g["lr"] for g in unit.optimizer.param_groups] for unit in trainer.step.units]
    lrs_then = lrs(first)
    train()  # epoch 2 goes on before the driver's command comes
    pipe.sent.append(SaveCheckpoint(("a", "b", "c"), 1))
    first._obey()
    assert drain(reports) == [CheckpointSaved("g", name, 1) for name in "abc"]
    resumed = Trainer(trainer_spec(group, tmp_path, start=1), queue.Queue())
    assert resumed.epoch == 1
    after = resumed.step.predict({"main": x})
    for name in "abc":
        assert torch.allclose(before[name], after[name], atol=1e-6), name
        saved = torch.load(tmp_path / name / "epoch1.pt", weights_only=True)
        plain = build_model("resnet", 10, saved["spec"]["width"], 12, 3, image_size=32)
        plain.load_state_dict(saved["model"])  # strict: a member's checkpoint is a plain model's
        plain.eval()
        with torch.no_grad():
            assert torch.allclose(torch.softmax(plain(x), 1), after[name], atol=1e-5), name
        assert saved["schedule_steps"] == 1
    # The learning rates go on from where they were at epoch 1's end, each member's own.
    assert lrs(resumed) == lrs_then != lrs(first)
    # A trainer that died while writing epoch 2's checkpoint: the members resume from epoch 1's.
    assert Trainer(trainer_spec(group, tmp_path, start=2), queue.Queue()).epoch == 1
    assert Trainer(trainer_spec(group, tmp_path / "none written", start=1), queue.Queue()).epoch == 0
    with pytest.raises(RuntimeError, match="keeps its state after \\[1\\]"):
        pipe.sent.append(SaveCheckpoint(("a",), 2))
        first._obey()


def test_pruning_keeps_the_newest_checkpoints_and_the_best(tmp_path):
    pipe = Pipe()
    trainer = Trainer(trainer_spec(GroupSpec("g", (model("a"),), 1), tmp_path), queue.Queue(), pipe)
    for epochs, accuracy in enumerate([0.5, 0.9, 0.6, 0.9, 0.7], start=1):
        trainer.epoch = epochs - 1  # the end of that epoch
        trainer._keep_state("a", accuracy)
        pipe.sent.append(SaveCheckpoint(("a",), epochs))
        trainer._obey()
    assert saved_epochs(tmp_path, "a") == [2, 4, 5]  # the best (the first of equals) and the newest two
    assert json.loads((tmp_path / "a" / "best.json").read_text()) == {"epochs": 2, "val_accuracy": 0.9}


def test_a_released_member_leaves_and_the_others_train_on_unchanged(tmp_path):
    """The command pipe: a member released between batches is gone before the next one; the others'
    weights then match a group that never had it."""
    members = (model("a"), model("b", lr=0.02), model("c", lr=0.05))
    images, labels = batch()
    inputs = lambda trainer: {"main": (normalise(images, trainer.device), torch.from_numpy(labels))}
    pipe = Pipe()
    trainer = Trainer(trainer_spec(GroupSpec("g", members, 3), tmp_path), queue.Queue(), pipe)
    without = Trainer(trainer_spec(GroupSpec("g", (members[0], members[2]), 2), tmp_path), queue.Queue())
    for t in (trainer, without):
        t.step.train(inputs(t))
    pipe.sent.append(ReleaseMember("b"))
    trainer._obey()
    assert trainer.members == ["a", "c"] and trainer.step.names == ["a", "c"] and not pipe.sent
    for t in (trainer, without):
        t.step.train(inputs(t))
    x = normalise(batch(2)[0], trainer.device)
    left, never = trainer.step.predict({"main": x}), without.step.predict({"main": x})
    assert set(left) == {"a", "c"}
    for name in "ac":
        assert torch.allclose(left[name], never[name], atol=1e-5), name


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


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
@pytest.mark.parametrize("array_size, threads", [(1, 1), (2, 1), (1, 2)])  # (1, 2): units step side by side
def test_a_training_step_never_waits_for_the_device(monkeypatch, precision, array_size, threads):
    """No host synchronisation inside a step: every way a tensor's value reaches Python is counted
    (item, float, bool, tolist, numpy, cpu, cuda.synchronize) and none may happen."""
    group = GroupSpec("g", (model("a"), model("b", lr=0.02), model("w", width=4)), array_size)
    step = GroupStep(group, 3, {"main": 32}, torch.device("cpu"), 10, precision, threads=threads)
    assert (step.pool is not None) == (threads > 1)
    images, labels = batch()
    inputs = {"main": (normalise(images, torch.device("cpu")), torch.from_numpy(labels))}
    step.train(inputs)  # the first step builds the optimisers' state: counted too, in the next
    syncs = []
    for name in ("item", "__float__", "__bool__", "tolist", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (syncs.append(_n),
                                                                                           _o(self, *a, **k))[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append("cuda.synchronize"))
    losses = step.train(inputs)
    assert syncs == []
    assert set(losses) == {"a", "b", "w"} and all(loss.dim() == 0 for loss in losses.values())
    float(losses["a"])  # reading a loss is a synchronisation: the count sees it
    assert syncs == ["__float__"]
    monkeypatch.undo()
    assert all(np.isfinite(float(loss)) for loss in losses.values())
