"""Members declared by `_target_` (pipeline/training/members.py): modules, optimisers, schedules and losses
nobody here wrote train, checkpoint and resume as the built-in families do; a declaration that cannot
train is one MemberError naming the member and key, found before a run starts."""
import copy
import io
import math
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pipeline.training.group import GroupSpec, GroupStep
from pipeline.training.members import (CONF, MemberError, ModelSpec, build_module, check_members,
                                       optimizer_state_bytes)
from tests.conftest import member

CLASSES = 3
STEPS = 40  # the run's training steps, for the schedules


class SmallNet(nn.Module):
    """A user's own module: conv, batch norm, residual add, concatenation, dropout (off in these tests), linear."""

    def __init__(self, num_classes: int, channels: int = 4, dropout: float = 0.0):
        super().__init__()
        # no bias before batch norm, as usual: its gradient is rounding noise, which AdamW's step makes lr-sized
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU())
        self.branch = nn.Conv2d(channels, channels, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout),
                                  nn.Linear(2 * channels, num_classes))

    def forward(self, x):
        x = self.stem(x)
        return self.head(torch.cat([x, x + self.branch(x)], dim=1))


class ReadsValues(SmallNet):
    """A forward that reads a value (as some modules do), which the meta device cannot give."""

    def forward(self, x):
        if x.abs().sum().item() < 0:
            raise AssertionError("never")
        return super().forward(x)


def counts_out_channels(out_channels, **kwargs):
    """A callable whose **kwargs go to a class that does not take num_classes (MONAI's DenseNet121)."""
    return CountsOutChannels(out_channels, **kwargs)


class CountsOutChannels(SmallNet):
    def __init__(self, out_channels: int, channels: int = 4):
        super().__init__(out_channels, channels)


def not_a_module(num_classes):
    return "a string"


def raises(num_classes):
    raise RuntimeError("weights file missing")


class BrokenSchedule(torch.optim.lr_scheduler.LRScheduler):
    """A user's schedule that builds, then fails as training steps it."""

    def get_lr(self):
        if self.last_epoch > 0:
            raise ValueError(f"no rate for step {self.last_epoch}")
        return self.base_lrs


class TwoMetrics(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """A user's schedule that steps on two figures, where a member's is given one."""

    def step(self, accuracy, loss):
        super().step(loss)


def declared(name="u", model=None, **keys) -> ModelSpec:
    """A user's member: SmallNet unless `model` says otherwise, the shipped defaults unless `keys` do."""
    spec = replace(member(name), model=model or {"_target_": "tests.test_members.SmallNet", "channels": 4})
    return replace(spec, **keys)


@pytest.mark.parametrize("spec, message", [
    (declared(model={"_target_": "mypkg.nets.Small"}),
     r"model \(mypkg.nets.Small\): cannot import mypkg.nets.Small: no module mypkg on the Python path"),
    (declared(model={"_target_": "tests.test_members.raises"}), r"model \(tests.test_members.raises\): weights file "
                                                                r"missing"),
    (declared(model={"_target_": "tests.test_members.not_a_module"}), r"model .*: it returned a str, not a torch.nn"),
    (declared(model={"_target_": "tests.test_members.SmallNet", "num_classes": 5}),
     r"model .*: on a batch of 2 images of 16 px it returned \(2, 5\), not logits of shape \(2, 3\)"),
    (declared(model={"_target_": "tests.test_members.SmallNet", "width": 5}),
     r"model .*got an unexpected keyword argument 'width'"),
    (declared(optimizer={"_target_": "torch.nn.Linear", "in_features": 2}),
     r"optimizer \(torch.nn.Linear\): "),
    (declared(optimizer={"_target_": "torch.optim.AdamW", "lr": -1.0}), r"optimizer .*Invalid learning rate: -1.0"),
    (declared(optimizer={"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "nesterov": True}),
     r"optimizer .*Nesterov momentum requires a momentum"),
    (declared(lr_scheduler={"_target_": "torch.optim.SGD"}), r"lr_scheduler \(torch.optim.SGD\): "),
    (declared(lr_scheduler={"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "mode": "max"}),
     r"lr_scheduler \(torch.optim.lr_scheduler.ReduceLROnPlateau\): mode='max', but it is stepped on the member's "
     r"validation loss, which falls as the member improves: give mode: min \(the default\)"),
    (declared(lr_scheduler={"_target_": "tests.test_members.TwoMetrics"}),
     r"lr_scheduler \(tests.test_members.TwoMetrics\): its step\(\) needs accuracy, loss, but a member's schedule "
     r"is stepped after every training step with no argument, or once an epoch with the member's validation loss"),
    (declared(lr_scheduler={"_target_": "tests.test_members.BrokenSchedule"}),
     r"lr_scheduler \(tests.test_members.BrokenSchedule\): no rate for step 1"),
    (declared(lr_scheduler={"_target_": "pipeline.training.members.cosine", "warmup_fraction": 1}),
     r"lr_scheduler \(pipeline.training.members.cosine\): warmup_fraction is the share of the run's steps that warm "
     r"up: in \[0, 1\), got 1"),
    (declared(loss={"_target_": "torch.nn.CrossEntropyLoss", "reduction": "none"}),
     r"loss .*it must return one mean loss"),
])
def test_a_declaration_that_cannot_train_is_one_error_naming_the_member_and_key(spec, message):
    """Each mistake as a user makes it; found by the dry build (meta device), before anything starts."""
    with pytest.raises(MemberError, match=rf"^ensemble member u: {message}") as err:
        check_members([member("fine"), spec], CLASSES, {"main": 16}, STEPS)
    assert "\n" not in str(err.value) and "fix ensemble.models' u." in str(err.value)
    key = str(err.value).split(": ")[1].split(" ")[0]
    assert (f"or ensemble.{key} " in str(err.value)) == (key != "model")  # where the ensemble's keys may be wrong


@pytest.mark.parametrize("preset", sorted(f"{p.parent.name}/{p.stem}" for key in ("optimizer", "lr_scheduler", "loss")
                                           for p in (CONF / key).glob("*.yaml")))
def test_every_shipped_preset_builds(preset):
    """Each file of pipeline/conf/optimizer, lr_scheduler and loss, as a member's whole config for its key,
    passes the dry build (a preset no test builds could ship broken)."""
    from omegaconf import OmegaConf

    key = preset.split("/")[0]
    check_members([declared(**{key: OmegaConf.to_container(OmegaConf.load(CONF / f"{preset}.yaml"))})], CLASSES,
                  {"main": 16}, STEPS)


@pytest.mark.parametrize("total, fraction, factors", [
    (10, 0.3, [1 / 4, 2 / 4, 3 / 4, 1, 0.5 * (1 + math.cos(math.pi / 7))]),  # then cosine over the other 7 steps
    (10, 0.0, [1, 0.5 * (1 + math.cos(math.pi / 10))]),  # the default: no warm-up
    (2, 0.99, [1 / 2, 1, 0]),  # the cosine keeps a step
])
def test_the_built_in_schedule_warms_up_then_anneals_to_zero(total, fraction, factors):
    """pipeline.training.members.cosine: a linear warm-up over the first warmup_fraction of the run's steps,
    from 1/warm-up steps of each rate to the rate, then cosine annealing to 0 at the run's last step."""
    from pipeline.training.members import cosine

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = cosine(optimizer, total, fraction)
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(total):
        optimizer.step()
        schedule.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates[:len(factors)] == pytest.approx([0.1 * f for f in factors]) and rates[-1] == pytest.approx(0)


def warmup_cosine(optimizer, total_steps: int, warmup: int = 2):
    """A user's schedule over the run's steps: a linear warm-up, then cosine annealing over the rest."""
    from torch.optim import lr_scheduler

    return lr_scheduler.SequentialLR(optimizer, [lr_scheduler.LinearLR(optimizer, 0.1, total_iters=warmup),
                                                 lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps - warmup)],
                                     milestones=[warmup])


@pytest.mark.parametrize("schedule", [
    {"_target_": "tests.test_members.warmup_cosine", "_partial_": True, "warmup": 1},
    {"_target_": "torch.optim.lr_scheduler.OneCycleLR", "_partial_": True, "max_lr": 0.1},
    {"_target_": "torch.optim.lr_scheduler.CosineAnnealingWarmRestarts", "_partial_": True, "T_0": 10},
    {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "_partial_": True},  # stepped on a loss
])
def test_a_schedule_is_stepped_dry_over_the_run_s_steps_and_says_nothing(schedule):
    """The dry step builds a schedule over the run's steps (at 1 step, the warm-up's cosine would have none and
    divide by zero), and it warns of no step before the optimiser's (training steps the optimiser first)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_members([declared(lr_scheduler=schedule)], CLASSES, {"main": 16}, STEPS)


def test_a_module_that_reads_values_is_checked_on_the_cpu():
    """Meta tensors have no values: such a module's check runs again on the CPU, and passes there."""
    check_members([declared(model={"_target_": "tests.test_members.ReadsValues"})], CLASSES, {"main": 16}, STEPS)


def test_the_project_gives_num_classes_and_image_size_where_the_callable_takes_them():
    """SmallNet takes num_classes only; the built-in resnet takes image_size too (its stem depends on it)."""
    assert build_module(declared(), CLASSES, 16).head[-1].out_features == CLASSES
    small, large = (build_module(member("r"), CLASSES, side) for side in (32, 64))
    assert small.features[0][0].kernel_size == (3, 3) and large.features[0][0].kernel_size == (7, 7)



def test_a_callable_whose_kwargs_refuse_num_classes_is_called_as_declared():
    """Offered through **kwargs, num_classes is withdrawn when they refuse it (MONAI's DenseNet121 failed so
    with the class count set as its out_channels); the same seed builds the same weights; a wrong count of its
    own is the dry check's error, naming the dataset's."""
    spec = declared(model={"_target_": "tests.test_members.counts_out_channels", "out_channels": CLASSES,
                           "channels": 5})
    module = build_module(spec, CLASSES, 16)
    assert module.head[-1].out_features == CLASSES and module.branch.out_channels == 5
    assert torch.equal(build_module(spec, CLASSES, 16).branch.weight, module.branch.weight)
    wrong = declared(model={"_target_": "tests.test_members.counts_out_channels", "out_channels": CLASSES + 1})
    with pytest.raises(MemberError, match=f"shape \\(2, {CLASSES}\\) for the dataset's {CLASSES} classes"):
        check_members([wrong], CLASSES, {"main": 16}, STEPS)


@pytest.mark.parametrize("optimizer, buffers", [
    ({"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}, 1),
    ({"_target_": "torch.optim.SGD", "lr": 0.1}, 0),
    ({"_target_": "torch.optim.AdamW", "lr": 1e-3}, 2),
    ({"_target_": "torch.optim.Adam", "lr": 1e-3, "amsgrad": True}, 3),
    ({"_target_": "torch.optim.Adagrad", "lr": 0.1}, 1),  # reads a value in its step: counted on the CPU
])
def test_the_memory_estimate_counts_what_the_members_optimiser_keeps(optimizer, buffers):
    """Buffers the size of the parameters, per optimiser; the mistake it catches: one formula for all (SGD's
    momentum), which counts AdamW's state half and a momentum-free SGD's as one buffer."""
    module = build_module(declared(), CLASSES, 16)
    parameter_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    assert optimizer_state_bytes(declared(optimizer=optimizer), module) == buffers * parameter_bytes


def test_each_member_starts_from_its_own_seed_alone_or_fused():
    """Members differing only in seed start apart; a member's initial weights are the same whether it trains
    alone or in a fused array (a group built under one seed for all, as before, fails the first check)."""
    a, b = member("a", seed=1), member("b", seed=2, lr=0.05)
    alone = {m.name: build_module(m, CLASSES, 32).state_dict() for m in (a, b)}
    assert not torch.equal(alone["a"]["features.0.0.weight"], alone["b"]["features.0.0.weight"])
    fused = GroupStep(GroupSpec("g", (a, b), array_size=2), CLASSES, {"main": 32}, "cpu", total_steps=10)
    assert len(fused.units) == 1 and fused.units[0].names == ("a", "b")
    for m in (a, b):
        state = fused.state(m.name)["model"]
        for key, tensor in alone[m.name].items():
            assert torch.equal(state[key], tensor), (m.name, key)


def test_a_users_module_and_optimiser_train_checkpoint_and_resume():
    """SmallNet with AdamW, a step schedule (stepped after every training step) and label smoothing, packed
    beside a built-in member: it learns a fixed batch, its rate follows StepLR, and a new group loaded from
    its checkpoint predicts the same and goes on at the same rate."""
    user = declared(optimizer={"_target_": "torch.optim.AdamW", "lr": 0.03},
                    lr_scheduler={"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 4, "gamma": 0.5},
                    loss={"_target_": "torch.nn.CrossEntropyLoss", "label_smoothing": 0.1})
    group = GroupSpec("g", (user, member("r")))
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, CLASSES, (8,))
    step = GroupStep(group, CLASSES, {"main": 16}, "cpu", total_steps=100)
    losses = [float(step.train({"main": (x, y)})["u"]) for _ in range(10)]
    assert losses[-1] < 0.7 * losses[0], losses
    unit, _ = step._find("u")
    assert type(unit.optimizer) is torch.optim.AdamW
    assert unit.optimizer.param_groups[0]["lr"] == pytest.approx(0.03 * 0.5 ** (10 // 4))
    saved = io.BytesIO()
    torch.save(step.state("u"), saved)  # as a checkpoint is: plain containers and tensors
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    resumed = GroupStep(group, CLASSES, {"main": 16}, "cpu", total_steps=100)
    resumed.load("u", state)
    before, after = step.predict({"main": x})["u"], resumed.predict({"main": x})["u"]
    assert torch.allclose(before, after)
    for group_step in (step, resumed):
        for _ in range(2):
            group_step.train({"main": (x, y)})
    assert resumed._find("u")[0].optimizer.param_groups[0]["lr"] == pytest.approx(0.03 * 0.5 ** (12 // 4))
    assert torch.allclose(step.predict({"main": x})["u"], resumed.predict({"main": x})["u"], atol=1e-6)


@pytest.mark.parametrize("target, on_gpu", [("torch.optim.SGD", {"fused": True}),
                                            ("torch.optim.AdamW", {"fused": True, "capturable": True}),
                                            ("torch.optim.adam.Adam", {"fused": True, "capturable": True}),
                                            ("torch.optim.RMSprop", None)])
def test_an_optimiser_whose_update_a_cuda_graph_can_hold_is_built_so_on_a_gpu_only(target, on_gpu):
    """SGD, Adam and AdamW (by the class their `_target_` names, however spelt) are built fused on a GPU, Adam
    and AdamW capturable, so that a graph holds their step; another optimiser, one declared with foreach
    (which fused excludes) or declared not fused, and any on a CPU step eagerly as declared; a rate cached
    for a GPU with graphs says whether each member's update is captured (Adam's was measured eager before)."""
    from pipeline.training.rates import cache_key
    from pipeline.training.group import graph_safe_arguments

    spec = declared(optimizer={"_target_": target, "lr": 0.01})
    assert graph_safe_arguments(spec, torch.device("cuda")) == on_gpu
    assert graph_safe_arguments(spec, torch.device("cpu")) is None
    for setting in ({"foreach": True}, {"fused": False}, {"foreach": False, "fused": False}):
        assert graph_safe_arguments(declared(optimizer={"_target_": target, "lr": 0.01, **setting}),
                                    torch.device("cuda")) is None
    assert graph_safe_arguments(declared(optimizer={"_target_": target, "lr": 0.01, "foreach": False}),
                                torch.device("cuda")) == on_gpu
    # OneCycleLR cycles the momentum (betas) too, which the fused kernels take as numbers: a graph would replay
    # the momentum of the step it captured, so such a member steps eagerly; without cycle_momentum it is captured
    one_cycle = {"_target_": "torch.optim.lr_scheduler.OneCycleLR", "max_lr": 0.1}
    assert graph_safe_arguments(declared(optimizer={"_target_": target, "lr": 0.01}, lr_scheduler=one_cycle),
                                torch.device("cuda")) is None
    assert graph_safe_arguments(declared(optimizer={"_target_": target, "lr": 0.01},
                                         lr_scheduler={**one_cycle, "cycle_momentum": False}),
                                torch.device("cuda")) == on_gpu
    how = lambda kind: SimpleNamespace(device_kind=kind, cuda_graphs=True, image_sizes={"main": 16}, num_classes=3,
                                       batch_size=8, precision="fp32", compile=False)
    keys = {kind: cache_key(GroupSpec("g", (spec,)), how(kind), {"device_kind": kind}) for kind in ("cuda", "cpu")}
    ((*member, captured),) = keys["cuda"]["members"]
    assert captured is (on_gpu is not None) and keys["cpu"]["members"] == [member]


def test_a_graph_safe_adamws_checkpoint_is_plain_and_resumes_with_the_loading_optimisers_settings():
    """AdamW as a GPU builds it for graphs (fused, its rate a tensor the schedule fills; capturable is left out
    here, since a CPU cannot step it) checkpoints as a plain AdamW's (no fused or capturable, rates as
    floats); loaded into a plain AdamW it keeps that one's settings and steps as the fused one does; loaded
    into a fused one, its rate tensor holds the checkpoint's rate. A checkpoint carrying its device's
    settings, or a load dropping the loader's, fails."""
    from pipeline.training.group import _load_plain_checkpoint, _plain_checkpoint

    def built(fused: bool):
        torch.manual_seed(0)
        net = SmallNet(CLASSES)
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.03, **({"fused": True} if fused else {}))
        if fused:
            optimizer.param_groups[0]["lr"] = torch.tensor(0.03)
        return net, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    def step(net, optimizer, schedule):
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        schedule.step()

    x, y = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2] * 2 + [0, 1])
    trained = built(fused=True)
    for _ in range(3):
        step(*trained)
    state = _plain_checkpoint(trained[0].state_dict(), trained[1], trained[2])
    (group,) = state["optimizer"]["param_groups"]
    assert "fused" not in group and "capturable" not in group and type(group["lr"]) is float
    assert group["lr"] == pytest.approx(0.03 * 0.5)
    reference = copy.deepcopy(trained)  # its next step, which the resumed ones must take
    step(*reference)
    for fused in (False, True):
        net, optimizer, schedule = resumed = built(fused)
        rate = optimizer.param_groups[0]["lr"]
        saved = io.BytesIO()
        torch.save(state, saved)  # as a checkpoint is written and read
        saved.seek(0)
        checkpoint = torch.load(saved, weights_only=True)
        net.load_state_dict(checkpoint["model"])
        _load_plain_checkpoint(checkpoint, optimizer, schedule)
        assert optimizer.param_groups[0]["fused"] is (True if fused else None)
        assert optimizer.param_groups[0]["capturable"] is False
        assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(0.03 * 0.5)
        assert (optimizer.param_groups[0]["lr"] is rate) is fused  # the tensor a graph reads, filled
        step(*resumed)
        for key, tensor in reference[0].state_dict().items():
            torch.testing.assert_close(net.state_dict()[key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def test_a_schedule_on_a_metric_steps_once_an_epoch_on_its_members_validation_loss_and_resumes():
    """ReduceLROnPlateau on two members of a vmap array, beside a cosine member: training steps leave their
    rates alone (the cosine's moves), each steps on its own validation loss, a loss that is not a number
    steps none, and a checkpoint keeps the rate and the plateau's count."""
    plateau = {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "_partial_": True, "factor": 0.5,
               "patience": 1}
    p, q = (declared(name, lr_scheduler=plateau, seed=seed) for name, seed in (("p", 1), ("q", 2)))
    group = GroupSpec("g", (p, q, member("r")), array_size=2)
    step = GroupStep(group, CLASSES, {"main": 16}, "cpu", total_steps=STEPS)
    assert [unit.names for unit in step.units] == [("p", "q"), ("r",)]
    assert step.stepped_on_validation == ["p", "q"]
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, CLASSES, (8,))
    r_before = step.rate("r")
    for _ in range(3):
        step.train({"main": (x, y)})
    assert (step.rate("p"), step.rate("q")) == (0.1, 0.1)  # the preset SGD's rate, not stepped by training
    assert step.rate("r") < r_before
    for p_loss, q_loss in ((1.0, 1.0), (0.5, math.nan), (0.4, math.nan)):  # NaN: no loss to judge, no step
        step.step_schedules({"p": p_loss, "q": q_loss})
    assert (step.rate("p"), step.rate("q")) == (0.1, 0.1)
    for p_loss, q_loss in ((0.3, 1.5), (0.2, 1.2)):  # q: worse than its best twice, over patience 1
        step.step_schedules({"p": p_loss, "q": q_loss})
    assert step.rate("p") == 0.1 and step.rate("q") == pytest.approx(0.05)
    saved = io.BytesIO()
    torch.save(step.state("q"), saved)
    saved.seek(0)
    resumed = GroupStep(group, CLASSES, {"main": 16}, "cpu", total_steps=STEPS)
    resumed.load("q", torch.load(saved, weights_only=True))
    assert resumed.rate("q") == pytest.approx(0.05)
    for group_step in (step, resumed):  # the plateau's best (1.0) and count (0, after the cut) came back
        group_step.step_schedules({"p": 1.0, "q": 1.2})
        group_step.step_schedules({"p": 1.0, "q": 1.2})
    assert step.rate("q") == resumed.rate("q") == pytest.approx(0.025)
