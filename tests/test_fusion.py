"""Fused arrays (pipeline/training/fusion.py) against the plain models they fuse:
each fused layer against its plain one, then whole models trained fused and
apart, checkpoints both ways, a member leaving, LR schedules and channels_last."""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.training.fusion import FusedArray, FusedLinear, FusedSGD
from pipeline.training.models import DenseLayer, densenet, resnet

torch.set_num_threads(1)  # tiny models: threads only contend (as in test_models)

NUM_CLASSES = 5
BATCH = 8
RESNET = (resnet, dict(depth=10, width=4))  # (family, its arguments)
DENSENET = (densenet, dict(depth=10, width=8, growth_rate=4))
# Up to 32 px the models take the 3x3 stem, above it the 7x7 + max-pool one.
EVERY_MODEL_AND_STEM = pytest.mark.parametrize(
    "config, image_size", [(RESNET, 16), (RESNET, 40), (DENSENET, 16), (DENSENET, 40)],
    ids=["resnet-3x3stem", "resnet-7x7stem", "densenet-3x3stem", "densenet-7x7stem"])
EVERY_MODEL = pytest.mark.parametrize("config", [RESNET, DENSENET], ids=["resnet", "densenet"])
# Three members that share no hyper-parameter.
HYPER = {"lrs": [0.05, 0.02, 0.1], "momenta": [0.9, 0.8, 0.5], "weight_decays": [5e-4, 0.0, 1e-2]}
# fp32: fused kernels sum in other orders than the plain ones.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
TRAINING_TOLERANCE = {"rtol": 1e-9, "atol": 1e-11}  # float64 (the fixture below)


@pytest.fixture
def float64():
    """Training compared step by step runs in float64. In float32 the fused and
    plain kernels' different roundoff can flip a ReLU on an activation within
    ~1e-6 of zero: a discrete change of one gradient, which later steps amplify
    (seen: a 1e-4 difference in a stem conv's momentum after 5 steps)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)


def seeded(make, seeds=(1, 2, 3)) -> list[nn.Module]:
    """One module per seed: members start from different weights."""
    modules = []
    for seed in seeds:
        torch.manual_seed(seed)
        modules.append(make())
    return modules


def plain_models(config, image_size, seeds=(1, 2, 3)) -> list[nn.Module]:
    family, arguments = config
    return seeded(lambda: family(num_classes=NUM_CLASSES, image_size=image_size, **arguments), seeds)


def fused_module(modules: list[nn.Module]) -> nn.Module:
    k = len(modules)
    return FusedArray(modules, [0.1] * k, [0.9] * k, [0.0] * k).module


def batches(image_size: int, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 3, image_size, image_size, generator=generator),
             torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator)) for _ in range(steps)]


def fused_and_apart(config, image_size=16) -> tuple[list[nn.Module], FusedArray, list[torch.optim.SGD]]:
    """Three plain models, the fused array made of their weights, and the SGD that trains each apart."""
    models = plain_models(config, image_size)
    return models, FusedArray(models, **HYPER), sgds(models, **HYPER)


def sgds(models, lrs, momenta, weight_decays) -> list[torch.optim.SGD]:
    return [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=True)
            for m, lr, momentum, weight_decay in zip(models, lrs, momenta, weight_decays)]


def train_apart(models, optimizers, data, schedules=()) -> torch.Tensor:
    """Each model trained on its own; the losses, [steps, models]."""
    losses = []
    for x, y in data:
        step_losses = []
        for model, optimizer in zip(models, optimizers):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step_losses.append(loss.detach())
        for schedule in schedules:
            schedule.step()
        losses.append(torch.stack(step_losses))
    return torch.stack(losses)


def train_fused(array: FusedArray, data, schedule=None, scaler=None) -> torch.Tensor:
    """The array trained; the losses, [steps, members]."""
    losses = []
    for x, y in data:
        step_losses = array.losses(array.module(x), y)
        array.optimizer.zero_grad()
        if scaler is None:
            step_losses.sum().backward()
            array.optimizer.step()
        else:
            scaler.scale(step_losses.sum()).backward()
            scaler.step(array.optimizer)
            scaler.update()
        if schedule is not None:
            schedule.step()
        losses.append(step_losses.detach())
    return torch.stack(losses)


def assert_member_is(array: FusedArray, i: int, model: nn.Module, optimizer: torch.optim.SGD,
                     same_step_count: bool = True) -> None:
    """Member i has the model's weights and BN statistics, and the optimiser's momentum and hyper-parameters.
    same_step_count=False: the model took other steps than the array, whose BN step count all members share."""
    state = array.member_state(i)
    expected_model = model.state_dict()
    if not same_step_count:
        expected_model = {name: state["model"][name] if t.dim() == 0 else t for name, t in expected_model.items()}
    torch.testing.assert_close(state["model"], expected_model, **TRAINING_TOLERANCE)
    expected = optimizer.state_dict()
    torch.testing.assert_close(state["optimizer"]["state"], expected["state"], **TRAINING_TOLERANCE)
    assert state["optimizer"]["param_groups"] == expected["param_groups"]


def member_major(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-member activations [N, C, ...] as the fused module holds them, [N, k*C, ...]."""
    return torch.cat(tensors, dim=1)


def member_part(fused: torch.Tensor, i: int, members: int = 3) -> torch.Tensor:
    return fused.unflatten(1, (members, -1))[:, i]


def is_channels_last(module: nn.Module) -> bool:
    return all(p.is_contiguous(memory_format=torch.channels_last) for p in module.parameters() if p.dim() == 4)


# Each fused layer against its plain one.


def test_first_conv_is_one_ordinary_conv_on_the_shared_images():
    convs = seeded(lambda: nn.Sequential(nn.Conv2d(3, 4, 7, stride=2, padding=3, bias=False)))
    fused = fused_module(convs)
    assert (fused[0].in_channels, fused[0].out_channels, fused[0].groups) == (3, 12, 1)
    images = torch.randn(2, 3, 12, 12)
    out = fused(images)
    for i, conv in enumerate(convs):
        torch.testing.assert_close(member_part(out, i), conv(images), **TOLERANCE)


def test_conv_is_a_grouped_conv_with_a_group_per_member():
    nets = seeded(lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 6, 3, stride=2, padding=1)))
    conv = fused_module(nets)[1]
    assert (conv.in_channels, conv.out_channels, conv.groups) == (12, 18, 3)
    inputs = [torch.randn(2, 4, 9, 9) for _ in nets]
    out = conv(member_major(inputs))
    for i, (net, x) in enumerate(zip(nets, inputs)):
        torch.testing.assert_close(member_part(out, i), net[1](x), **TOLERANCE)


def test_batch_norm_is_per_member_batch_norm():
    nets = seeded(lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    for net in nets:  # members with different affine parameters and running statistics
        nn.init.normal_(net[1].weight)
        nn.init.normal_(net[1].bias)
        net[1](torch.randn(6, 4, 5, 5) * 3 + 1)
    batch_norm = fused_module(nets)[1]
    inputs = [torch.randn(6, 4, 5, 5) * (i + 1) for i in range(len(nets))]
    out = batch_norm(member_major(inputs))  # training: batch statistics, running ones updated
    for i, (net, x) in enumerate(zip(nets, inputs)):
        torch.testing.assert_close(member_part(out, i), net[1](x), **TOLERANCE)
    batch_norm.eval()
    out = batch_norm(member_major(inputs))
    for i, (net, x) in enumerate(zip(nets, inputs)):
        torch.testing.assert_close(member_part(out, i), net[1].eval()(x), **TOLERANCE)


def test_linear_is_a_batched_matmul_giving_logits_per_member():
    nets = seeded(lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5)))
    linear = fused_module(nets)[3]
    assert isinstance(linear, FusedLinear)
    inputs = [torch.randn(2, 4) for _ in nets]
    logits = linear(member_major(inputs))
    assert logits.shape == (3, 2, 5)
    for i, (net, x) in enumerate(zip(nets, inputs)):
        torch.testing.assert_close(logits[i], net[3](x), **TOLERANCE)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_dense_layer_concatenates_each_members_channels(memory_format):
    nets = seeded(lambda: nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), DenseLayer(6, 4)))
    dense_layer = fused_module(nets)[1]
    inputs = [torch.randn(2, 6, 5, 5) for _ in nets]
    out = dense_layer(member_major(inputs).contiguous(memory_format=memory_format))
    assert out.shape == (2, 3 * (6 + 4), 5, 5)
    assert out.is_contiguous(memory_format=memory_format)  # the layout the group trains in carries through
    for i, (net, x) in enumerate(zip(nets, inputs)):
        torch.testing.assert_close(member_part(out, i), net[1](x), **TOLERANCE)


def test_fused_sgd_steps_each_member_as_torch_sgd_does():
    member_shapes = [(4, 3, 3, 3), (4,), (5, 4)]  # a conv's, a batch norm's and a classifier's weights
    fused_shapes = [(3 * 4, 3, 3, 3), (3 * 4,), (3, 5, 4)]
    torch.manual_seed(0)
    fused = [nn.Parameter(torch.randn(shape)) for shape in fused_shapes]
    fused[0].data = fused[0].data.contiguous(memory_format=torch.channels_last)  # as a GPU trainer holds convs
    members = [[nn.Parameter(p.detach().reshape(3, *shape)[i].clone()) for p, shape in zip(fused, member_shapes)]
               for i in range(3)]
    fused_optimizer = FusedSGD(fused, **HYPER)
    optimizers = [torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=True)
                  for params, lr, momentum, weight_decay in zip(members, *HYPER.values())]
    for _ in range(5):
        for j, (p, shape) in enumerate(zip(fused, member_shapes)):
            p.grad = torch.randn(fused_shapes[j])
            for i, params in enumerate(members):
                params[j].grad = p.grad.reshape(3, *shape)[i].clone()
        fused_optimizer.step()
        for optimizer in optimizers:
            optimizer.step()
    for i, params in enumerate(members):
        for p, member, shape in zip(fused, params, member_shapes):
            torch.testing.assert_close(p.detach().reshape(3, *shape)[i], member.detach(), rtol=1e-6, atol=1e-7)


def test_only_models_of_one_architecture_made_of_fusable_layers_fuse():
    with pytest.raises(ValueError, match="architecture"):
        FusedArray(plain_models(RESNET, 16, seeds=(1,)) + plain_models(DENSENET, 16, seeds=(2,)),
                   [0.1] * 2, [0.9] * 2, [0.0] * 2)
    with pytest.raises(TypeError, match="GroupNorm"):
        fused_module(seeded(lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.GroupNorm(2, 4))))


# Whole models.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@EVERY_MODEL_AND_STEM
def test_fused_state_holds_each_members_tensors_member_major(config, image_size, dtype):
    models = [model.to(dtype) for model in plain_models(config, image_size)]
    fused_state = FusedArray(models, **HYPER).module.state_dict()
    assert fused_state.keys() == models[0].state_dict().keys()
    for name, fused in fused_state.items():
        for i, model in enumerate(models):
            plain = model.state_dict()[name]
            member = fused if fused.dim() == 0 else fused.reshape(len(models), *plain.shape)[i]
            assert member.dtype == plain.dtype and torch.equal(member, plain), name


@pytest.mark.usefixtures("float64")
@EVERY_MODEL_AND_STEM
def test_fused_training_equals_training_each_model_apart(config, image_size):
    models, array, optimizers = fused_and_apart(config, image_size)
    data = batches(image_size, steps=5)
    fused_losses = train_fused(array, data)
    torch.testing.assert_close(fused_losses, train_apart(models, optimizers, data), **TRAINING_TOLERANCE)
    for i, (model, optimizer) in enumerate(zip(models, optimizers)):
        assert_member_is(array, i, model, optimizer)
    images = data[0][0]
    logits = array.module.eval()(images)
    assert logits.shape == (3, BATCH, NUM_CLASSES)
    for i, model in enumerate(models):
        torch.testing.assert_close(logits[i], model.eval()(images), **TRAINING_TOLERANCE)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("config, image_size", [(RESNET, 40), (DENSENET, 16)], ids=["resnet", "densenet"])
def test_member_state_is_a_plain_models_checkpoint_that_trains_on_alone(config, image_size):
    array = FusedArray(plain_models(config, image_size), **HYPER)
    data = batches(image_size, steps=3)
    train_fused(array, data[:2])
    state = array.member_state(1)
    for tensor in state["model"].values():  # copies of the member's slices, not views of every member's storage
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    (model,) = plain_models(config, image_size, seeds=(9,))
    model.load_state_dict(state["model"], strict=True)
    images = data[2][0]
    torch.testing.assert_close(model.eval()(images), array.module.eval()(images)[1], **TRAINING_TOLERANCE)
    model.train()
    array.module.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.1)  # the state sets the hyper-parameters
    optimizer.load_state_dict(state["optimizer"])
    train_fused(array, data[2:])
    train_apart([model], [optimizer], data[2:])
    assert_member_is(array, 1, model, optimizer)


@EVERY_MODEL
def test_a_host_copy_of_the_states_gives_each_members_checkpoint_as_it_was_then(config):
    """What a trainer keeps at an epoch's end: one copy per fused tensor, each member's checkpoint built from it
    later, after more steps. Fails if the copy shares the live tensors, or builds another checkpoint than the
    array's own (weights, momentum, each member's rates under a schedule)."""
    array = FusedArray(plain_models(config, 16), **HYPER)
    schedule = torch.optim.lr_scheduler.LambdaLR(array.optimizer, lambda step: 0.5**step)
    data = batches(16, steps=3)
    train_fused(array, data[:2], schedule)
    copied = array.states().copied(lambda t: t.to("cpu", copy=True))
    expected = [array.member_state(i) for i in range(3)]
    train_fused(array, data[2:], schedule)
    for i in range(3):
        state = copied.member(i)
        assert state["model"].keys() == expected[i]["model"].keys()
        assert all(torch.equal(state["model"][name], t) for name, t in expected[i]["model"].items())
        for tensor in state["model"].values():  # the member's own slices
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        momentum = lambda s: {index: buffers["momentum_buffer"] for index, buffers in s["optimizer"]["state"].items()}
        assert momentum(state).keys() == momentum(expected[i]).keys() != set()
        assert all(torch.equal(momentum(state)[j], t) for j, t in momentum(expected[i]).items())
        assert state["optimizer"]["param_groups"] == expected[i]["optimizer"]["param_groups"]
        assert state["optimizer"]["param_groups"][0]["lr"] == HYPER["lrs"][i] * 0.25
    now = array.member_state(0)["model"]  # the array trained on meanwhile
    assert not all(torch.equal(now[name], t) for name, t in expected[0]["model"].items())


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("array_steps, alone_steps", [(0, 2), (2, 2), (2, 0)])
def test_a_member_resumes_from_a_model_trained_alone(array_steps, alone_steps):
    # The fused optimiser may or may not hold momentum already, and the loaded one may or may not.
    image_size = 16
    models, array, optimizers = fused_and_apart(DENSENET, image_size)
    (alone,) = plain_models(DENSENET, image_size, seeds=(9,))
    (alone_optimizer,) = sgds([alone], [0.03], [0.7], [1e-3])
    data = batches(image_size, steps=array_steps + 2)
    if array_steps:
        train_fused(array, data[:array_steps])
        train_apart(models, optimizers, data[:array_steps])
    if alone_steps:
        train_apart([alone], [alone_optimizer], batches(image_size, steps=alone_steps, seed=1))
    array.load_member_state(1, {"model": alone.state_dict(), "optimizer": alone_optimizer.state_dict()})
    models[1], optimizers[1] = alone, alone_optimizer
    fused_losses = train_fused(array, data[array_steps:])
    torch.testing.assert_close(fused_losses, train_apart(models, optimizers, data[array_steps:]), **TRAINING_TOLERANCE)
    for i, (model, optimizer) in enumerate(zip(models, optimizers)):
        assert_member_is(array, i, model, optimizer, same_step_count=array_steps == alone_steps)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("dropped", [0, 1, 2])
@EVERY_MODEL
def test_after_a_member_leaves_the_others_train_on_as_if_apart(config, dropped):
    image_size = 16
    models, array, optimizers = fused_and_apart(config, image_size)
    data = batches(image_size, steps=5)
    train_fused(array, data[:2])
    train_apart(models, optimizers, data[:2])
    old_tensors = [*array.module.parameters(), *array.module.buffers(),
                   *(state["momentum_buffer"] for state in array.optimizer.state.values())]
    old_references = [weakref.ref(t) for t in old_tensors]
    del old_tensors
    array.drop(dropped)
    gc.collect()
    assert all(reference() is None for reference in old_references), "the old module's memory is still held"
    assert array.members == 2
    kept = [j for j in range(3) if j != dropped]
    models, optimizers = [models[j] for j in kept], [optimizers[j] for j in kept]
    fused_losses = train_fused(array, data[2:])
    assert fused_losses.shape == (3, 2)
    torch.testing.assert_close(fused_losses, train_apart(models, optimizers, data[2:]), **TRAINING_TOLERANCE)
    for i, (model, optimizer) in enumerate(zip(models, optimizers)):
        assert_member_is(array, i, model, optimizer)


@pytest.mark.usefixtures("float64")
@EVERY_MODEL
def test_lr_schedule_and_grad_scaler_drive_every_members_lr_across_a_drop(config):
    image_size = 16
    models, array, optimizers = fused_and_apart(config, image_size)

    def factor(step):
        return 0.5**step

    schedule = torch.optim.lr_scheduler.LambdaLR(array.optimizer, factor)
    # fp32 gradients scaled by a power of two unscale exactly: the scaler changes no result.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    schedules = [torch.optim.lr_scheduler.LambdaLR(optimizer, factor) for optimizer in optimizers]
    data = batches(image_size, steps=5)
    fused_losses = train_fused(array, data[:3], schedule, scaler)
    torch.testing.assert_close(fused_losses, train_apart(models, optimizers, data[:3], schedules), **TRAINING_TOLERANCE)
    array.drop(0)  # the schedule and the scaler stay bound to the array's optimiser
    fused_losses = train_fused(array, data[3:], schedule, scaler)
    apart_losses = train_apart(models[1:], optimizers[1:], data[3:], schedules[1:])
    torch.testing.assert_close(fused_losses, apart_losses, **TRAINING_TOLERANCE)
    for i, (model, optimizer) in enumerate(zip(models[1:], optimizers[1:])):
        assert optimizer.param_groups[0]["lr"] == HYPER["lrs"][i + 1] * factor(5)
        assert_member_is(array, i, model, optimizer)


@pytest.mark.usefixtures("float64")
@EVERY_MODEL
def test_channels_last_gives_the_same_results(config):
    image_size = 16
    models = plain_models(config, image_size)
    contiguous = FusedArray(models, **HYPER)
    channels_last = FusedArray([m.to(memory_format=torch.channels_last) for m in models], **HYPER)
    assert is_channels_last(channels_last.module)  # the plain models' layout carries over
    data = batches(image_size, steps=4)
    data_channels_last = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in data]

    def assert_same_members():
        for i in range(contiguous.members):
            torch.testing.assert_close(channels_last.member_state(i), contiguous.member_state(i), **TRAINING_TOLERANCE)

    torch.testing.assert_close(train_fused(channels_last, data_channels_last[:3]),
                               train_fused(contiguous, data[:3]), **TRAINING_TOLERANCE)
    assert_same_members()
    contiguous.drop(1)
    channels_last.drop(1)
    assert is_channels_last(channels_last.module)  # kept by the rebuilt module
    torch.testing.assert_close(train_fused(channels_last, data_channels_last[3:]),
                               train_fused(contiguous, data[3:]), **TRAINING_TOLERANCE)
    assert_same_members()
    images = data[0][0]
    torch.testing.assert_close(channels_last.module.eval()(data_channels_last[0][0]),
                               contiguous.module.eval()(images), **TRAINING_TOLERANCE)
