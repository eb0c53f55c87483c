"""Fused arrays of any module (pipeline/training/stacked.py): members of a module nobody here wrote, fused by
vmap, train as they would apart, keep their own optimisers, leave the array and checkpoint as plain modules;
a module vmap rejects packs, and the run says why."""
import io
import math
from dataclasses import replace

import pytest
import torch
from rich.console import Console

from pipeline.run import _say_unfused
from pipeline.training.group import GroupSpec, GroupStep
from pipeline.training.members import build_module, build_optimizer, check_members
from tests.test_members import CLASSES, SmallNet, declared

SIDE = 16
SGD = {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}
ADAMW = {"_target_": "torch.optim.AdamW", "lr": 0.01, "betas": [0.9, 0.999], "weight_decay": 0.01}


class Branches(SmallNet):
    """Control flow that depends on an activation's values, which vmap cannot batch (each member's differ)."""

    def forward(self, x):
        if self.stem(x).abs().sum() < 0:
            raise AssertionError("never")
        return super().forward(x)


class Frozen(SmallNet):
    """Its stem's convolution is frozen (requires_grad False), as a fine-tuned backbone's layers are."""

    def __init__(self, num_classes: int, channels: int = 4):
        super().__init__(num_classes, channels)
        self.stem[0].weight.requires_grad_(False)


def members(optimizer: dict, keys: list[dict], model: dict | None = None) -> tuple:
    """SmallNet members (conv, batch norm, residual add, concatenation, dropout off, linear), each its own seed
    and `optimizer` with its own `keys` over it."""
    return tuple(declared(f"m{i}", model=model, seed=i, optimizer={**optimizer, **own}) for i, own in enumerate(keys))


def batches(steps: int, rows: int = 8):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, 3, SIDE, SIDE, generator=generator), torch.randint(0, CLASSES, (rows,),
                                                                                  generator=generator))
            for _ in range(steps)]


def group_step(models: tuple, array_size: int) -> GroupStep:
    return GroupStep(GroupSpec("g", models, array_size), CLASSES, {"main": SIDE}, "cpu", total_steps=20)


def assert_same_members(fused: GroupStep, apart: GroupStep, names) -> None:
    for name in names:
        mine, theirs = fused.state(name), apart.state(name)
        for key, tensor in theirs["model"].items():
            torch.testing.assert_close(mine["model"][key], tensor, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
        assert mine["lr_scheduler"]["_last_lr"] == pytest.approx(theirs["lr_scheduler"]["_last_lr"])


@pytest.mark.parametrize("optimizer, keys", [
    (SGD, [{"lr": 0.1}, {"lr": 0.05, "momentum": 0.5}, {"lr": 0.2, "weight_decay": 0.0}]),
    (ADAMW, [{"lr": 0.01}, {"lr": 0.003, "betas": [0.8, 0.99]}, {"lr": 0.02, "weight_decay": 0.1}]),
])
def test_k_members_fused_by_vmap_train_as_they_do_apart(optimizer, keys):
    """3 members, each its own seed and hyper-parameters, one fused array vs packed (each its own module), 4
    steps: every step's losses, then every weight and batch-norm statistic, equal within fp32 tolerance, and
    the predictions. The mistakes it catches (each planted once, each failed): the first member's
    hyper-parameters for all; the first member's gradient handed to all."""
    models = members(optimizer, keys)
    fused, apart = group_step(models, array_size=3), group_step(models, array_size=1)
    assert [type(unit).__name__ for unit in fused.units] == ["_Stacked"] and len(apart.units) == 3
    for x, y in batches(4):
        mine, theirs = fused.train({"main": (x, y)}), apart.train({"main": (x, y)})
        for name in fused.names:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    assert_same_members(fused, apart, fused.names)
    x, _ = batches(1)[0]
    mine, theirs = fused.predict({"main": x}), apart.predict({"main": x})  # eval mode: the running statistics
    for name in fused.names:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-5, msg=name)


def test_frozen_parameters_stay_frozen_in_a_vmapped_array():
    """A module with a frozen convolution: fused members train as apart and their frozen weights never move.
    The mistake it catches: every stacked parameter made trainable."""
    models = members(ADAMW, [{"lr": 0.01}, {"lr": 0.02}], {"_target_": "tests.test_stacked.Frozen", "channels": 4})
    fused, apart = group_step(models, array_size=2), group_step(models, array_size=1)
    frozen = {name: fused.state(name)["model"]["stem.0.weight"] for name in fused.names}
    for x, y in batches(2):
        fused.train({"main": (x, y)})
        apart.train({"main": (x, y)})
    assert_same_members(fused, apart, fused.names)
    for name in fused.names:
        assert torch.equal(fused.state(name)["model"]["stem.0.weight"], frozen[name])


def test_a_family_fuses_by_hfta_where_every_member_takes_it():
    """Built-in ResNets with Nesterov SGD (HFTA takes them) and one with AdamW (vmap only) are one family: in
    arrays of two, the two SGD members form HFTA's array and the AdamW one trains alone; in one array of
    three, vmap fuses all. The mistake it catches: the family chunked as declared, [sgd, adamw] by vmap
    (the slower) and [sgd] alone."""
    resnet = {"_target_": "pipeline.training.models.resnet", "depth": 10, "width": 4}
    sgd, adamw, sgd2 = members(SGD, [{}, {}, {"lr": 0.05}], resnet)
    adamw = replace(adamw, optimizer=ADAMW)
    kinds = {size: [(type(unit).__name__, unit.names) for unit in group_step((sgd, adamw, sgd2), size).units]
             for size in (2, 3)}
    assert kinds == {2: [("_Array", ("m0", "m2")), ("_Solo", ("m1",))], 3: [("_Stacked", ("m0", "m2", "m1"))]}


def test_a_member_leaves_a_vmapped_array_and_its_checkpoint_is_a_plain_modules():
    """AdamW members: m1's checkpoint (torch.load weights_only) loads strictly into the module its `_target_`
    builds and into a plain AdamW, and predicts as it did in the array; m1 leaves, and the others go on
    exactly as apart (their optimiser state kept through the restacking). An array resumed from the packed
    members' checkpoints goes on as they do. The mistakes it catches: a checkpoint of views (it would hold
    every member's rows), optimiser state lost or misassigned when a member leaves."""
    models = members(ADAMW, [{"lr": 0.01}, {"lr": 0.003}, {"lr": 0.02}])
    fused, apart = group_step(models, array_size=3), group_step(models, array_size=1)
    steps = batches(5)
    for x, y in steps[:2]:
        fused.train({"main": (x, y)})
        apart.train({"main": (x, y)})
    saved = _saved(fused.state("m1"))
    assert len(saved) < 1.5 * len(_saved(apart.state("m1")))  # its own rows, not the array's
    state = _loaded(saved)
    plain = build_module(models[1], CLASSES, SIDE)
    plain.load_state_dict(state["model"])  # strict
    build_optimizer(models[1], plain.parameters()).load_state_dict(state["optimizer"])
    x, _ = steps[2]
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.softmax(plain(x), -1), fused.predict({"main": x})["m1"])

    resumed = group_step(models, array_size=3)
    for name in resumed.names:
        resumed.load(name, _loaded(_saved(apart.state(name))))
    fused.release("m1")
    apart.release("m1")
    assert fused.names == ["m0", "m2"] and all(t.shape[0] == 2 for t in fused.units[0].array.params.values())
    for x, y in steps[2:]:
        for step in (fused, apart, resumed):
            step.train({"main": (x, y)})
    assert_same_members(fused, apart, ["m0", "m2"])
    assert_same_members(resumed, apart, ["m0", "m2"])


def _saved(state: dict) -> bytes:
    """A checkpoint as a trainer writes it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _loaded(saved: bytes) -> dict:
    return torch.load(io.BytesIO(saved), weights_only=True)


def test_members_of_one_seed_draw_their_own_dropout_masks_when_fused():
    """Two members with the same weights and dropout 0.5, fused: their first losses differ (each its own
    mask). The mistake it catches: vmap's randomness="same", one mask for all (equal losses)."""
    model = {"_target_": "tests.test_members.SmallNet", "channels": 4, "dropout": 0.5}
    a, b = (replace(m, seed=0) for m in members(SGD, [{}, {}], model))
    x, y = batches(1)[0]
    step = group_step((a, b), array_size=2)
    assert [type(unit).__name__ for unit in step.units] == ["_Stacked"]
    losses = step.train({"main": (x, y)})
    assert not torch.equal(losses["m0"], losses["m1"])


def test_a_module_vmap_rejects_packs_and_the_run_says_why():
    """Branches branches on an activation's value, which vmap cannot batch: check_members marks its members
    unfusable with vmap's own reason, they form no family (a group of them packs), and the run's first lines
    say so; SmallNet's members stay fusable. The mistake it catches: a member fused on its declaration alone,
    whose array would fail in the trainer after the run began."""
    rejected = members(SGD, [{}, {}], {"_target_": "tests.test_stacked.Branches", "channels": 4})
    fusable = members(SGD, [{}, {}])
    checked = check_members([*rejected, *(replace(m, name=f"ok{i}") for i, m in enumerate(fusable))], CLASSES,
                            {"main": SIDE}, 100)
    assert [m.unfusable is not None for m in checked] == [True, True, False, False]
    assert "data-dependent control flow" in checked[0].unfusable
    assert [len(unit) for unit in GroupSpec("g", tuple(checked), array_size=2).units()] == [1, 1, 2]
    console = Console(record=True, width=400)
    _say_unfused(checked, console)
    lines = console.export_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("note m0, m1 (Branches(channels=4)) pack, never fuse: vmap: ")


def test_members_warmed_up_alike_fuse_by_hfta_and_step_their_own_schedule():
    """The built-in cosine's warm-up (warmup_fraction) in one family: HFTA's array steps one schedule for its
    members, so those of one warm-up share an array (m0, m2) and the other trains alone, in arrays of two
    or three (not one vmap array of three: vmap is the slower, and captures no CUDA graph). Fused or apart,
    each member's rate and weights are the same. Fails if m0 and m1 shared an HFTA array (m1 would warm up
    on m0's schedule)."""
    resnet = {"_target_": "pipeline.training.models.resnet", "depth": 10, "width": 4}
    models = tuple(replace(m, lr_scheduler={**m.lr_scheduler, "warmup_fraction": fraction}) for m, fraction in
                   zip(members(SGD, [{}, {}, {}], resnet), (0.2, 0.0, 0.2)))
    kinds = {size: [(type(unit).__name__, unit.names) for unit in group_step(models, size).units] for size in (2, 3)}
    assert kinds == {size: [("_Array", ("m0", "m2")), ("_Solo", ("m1",))] for size in (2, 3)}
    fused, apart = group_step(models, array_size=2), group_step(models, array_size=1)
    for x, y in batches(2):
        fused.train({"main": (x, y)})
        apart.train({"main": (x, y)})
    warmed, annealed = 0.1 * 3 / 5, 0.1 * 0.5 * (1 + math.cos(math.pi * 2 / 20))  # step 2 of 20: of 4 warm-up steps
    assert [fused.rate(name) for name in ("m0", "m1", "m2")] == pytest.approx([warmed, annealed, warmed])
    assert [apart.rate(name) for name in ("m0", "m1", "m2")] == pytest.approx([warmed, annealed, warmed])
    assert_same_members(fused, apart, ("m0", "m1", "m2"))


def test_under_autocast_members_vmap_would_fuse_pack_and_the_run_says_why():
    """trainer.precision bf16: vmap applies no autocast, so AdamW members (vmap's) fused would train in fp32
    while packed ones train in bf16 (0.5% apart in loss after 3 steps): they pack, and the run's first
    lines say why; the Nesterov-SGD members (HFTA's, which autocast reaches) still fuse."""
    resnet = {"_target_": "pipeline.training.models.resnet", "depth": 10, "width": 4}
    sgd = members(SGD, [{}, {"lr": 0.05}], resnet)
    adamw = tuple(replace(m, name=f"a{i}", optimizer=ADAMW) for i, m in enumerate(members(SGD, [{}, {}])))
    checked = check_members([*sgd, *adamw], CLASSES, {"main": SIDE}, 20, "bf16")
    assert [m.unfusable for m in checked[:2]] == [None, None]
    assert all(m.unfusable and m.unfusable.startswith("vmap applies no autocast") for m in checked[2:])
    assert [type(u).__name__ for u in group_step(tuple(checked), 2).units] == ["_Array", "_Solo", "_Solo"]
    console = Console(record=True, width=400)
    _say_unfused(checked, console)
    assert console.export_text().splitlines() == [
        "note a0, a1 (SmallNet(channels=4)) pack, never fuse: vmap applies no autocast: fused by it, a member "
        "would train in fp32, not in trainer.precision's dtype as it does packed"]
    assert [m.unfusable for m in check_members([*sgd, *adamw], CLASSES, {"main": SIDE}, 20)] == [None] * 4
    # fp16: an HFTA array's one gradient scaler would skip every member's step for one member's overflow
    fp16 = check_members([*sgd, *adamw], CLASSES, {"main": SIDE}, 20, "fp16")
    assert [type(u).__name__ for u in group_step(tuple(fp16), 2).units] == ["_Solo"] * 4
    assert fp16[0].unfusable.startswith("trainer.precision=fp16: an array has one gradient scaler")


@pytest.mark.parametrize("optimizer, model, kind", [
    (SGD, {"_target_": "pipeline.training.models.resnet", "depth": 10, "width": 4}, "_Array"),
    (ADAMW, None, "_Stacked"),
])
def test_a_fused_member_reports_its_own_learning_rate_as_it_would_apart(optimizer, model, kind):
    """The rate tracking reads after an epoch (GroupStep.rate): each member's, on its cosine schedule, in
    HFTA's array (the schedule's scale on the member's own lr) and in vmap's (the member's optimiser).
    Fails if an array reports its first member's rate for all, or the schedule's scale for a rate."""
    models = members(optimizer, [{"lr": 0.1}, {"lr": 0.05}], model)
    fused, apart = group_step(models, array_size=2), group_step(models, array_size=1)
    assert [type(unit).__name__ for unit in fused.units] == [kind]
    for x, y in batches(3):
        fused.train({"main": (x, y)})
        apart.train({"main": (x, y)})
    rates = [apart.rate(name) for name in apart.names]
    assert rates[0] == pytest.approx(2 * rates[1]) and rates[0] < 0.1  # annealed, each from its own lr
    assert [fused.rate(name) for name in apart.names] == pytest.approx(rates)
