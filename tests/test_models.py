import pytest
import torch
import torch.nn.functional as F

from pipeline.training.models import (count_parameters, densenet, describe, estimate_training_bytes, kept_state_bytes,
                                      resnet)

torch.set_num_threads(1)

# The small variants of each family, as (family, its arguments).
SMALL_RESNET = (resnet, dict(depth=10, width=16))
SMALL_DENSENET = (densenet, dict(depth=40, width=24, growth_rate=12))
SMALL_MODELS = pytest.mark.parametrize("config", [SMALL_RESNET, SMALL_DENSENET], ids=["resnet", "densenet"])


def small_model(config, image_size=32, num_classes=10, **overrides):
    family, arguments = config
    return family(num_classes=num_classes, image_size=image_size, **(arguments | overrides))


@SMALL_MODELS
@pytest.mark.parametrize("image_size", [32, 64, 224])
def test_logits_have_one_row_per_image_and_one_column_per_class(config, image_size):
    model = small_model(config, image_size, num_classes=7)
    logits = model(torch.randn(2, 3, image_size, image_size))
    assert logits.shape == (2, 7)
    assert torch.isfinite(logits).all()


@SMALL_MODELS
def test_channels_last_gives_the_same_logits(config):
    model = small_model(config).eval()
    images = torch.randn(2, 3, 32, 32)
    expected = model(images)
    model = model.to(memory_format=torch.channels_last)
    logits = model(images.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@SMALL_MODELS
def test_default_stem_runs_on_every_image_size(config):
    family, arguments = config
    model = family(num_classes=3, **arguments)
    for image_size in (32, 299):
        assert model(torch.randn(2, 3, image_size, image_size)).shape == (2, 3)


@pytest.mark.parametrize(
    "family, depth, expected",
    [
        # torchvision's resnet18, resnet34 and densenet121, 1000 classes: each family's defaults
        (resnet, 18, 11_689_512),
        (resnet, 34, 21_797_672),
        (densenet, 121, 7_978_856),
    ],
)
def test_imagenet_models_have_the_published_parameter_counts(family, depth, expected):
    model = family(depth=depth)
    assert count_parameters(model) == expected


def test_cifar_densenet_bc_100_has_the_papers_parameter_count():
    model = densenet(100, 12, 24, num_classes=10, image_size=32)
    assert round(count_parameters(model) / 1e6, 1) == 0.8  # Huang et al., table 2


@pytest.mark.parametrize(
    "config, knob, values",
    [
        (SMALL_RESNET, "depth", [10, 18, 34]),
        (SMALL_RESNET, "width", [8, 16, 32]),
        (SMALL_DENSENET, "depth", [22, 40, 100, 121]),
        (SMALL_DENSENET, "width", [16, 24, 32]),
        (SMALL_DENSENET, "growth_rate", [6, 12, 24]),
    ],
)
def test_parameter_count_grows_with_each_size_knob(config, knob, values):
    counts = [count_parameters(small_model(config, **{knob: value})) for value in values]
    assert counts == sorted(set(counts))


def test_describe_names_the_model_and_its_size():
    assert describe(small_model(SMALL_RESNET)) == "resnet10 w16: 0.31M params"
    assert describe(small_model(SMALL_DENSENET)) == "densenet40 k12 w24: 0.18M params"


@pytest.mark.parametrize(
    "arguments, message",
    [
        ((resnet, dict(depth=50)), r"resnet depth must be one of 10, 18, 34; got 50"),
        ((densenet, dict(depth=41)), r"densenet depth must be 121, 169, 201, 264, or 4 \+ 6n"),
        ((densenet, dict(depth=4)), r"densenet depth .* got 4"),
        ((resnet, dict(width=0)), r"width must be a positive integer; got 0"),
        ((resnet, dict(width=2.5)), r"width must be a positive integer; got 2.5"),
        ((densenet, dict(depth=40, growth_rate=-1)), r"growth_rate must be a positive integer; got -1"),
        ((resnet, dict(num_classes=0)), r"num_classes must be a positive integer; got 0"),
    ],
)
def test_invalid_arguments_raise_a_value_error_that_says_what_is_valid(arguments, message):
    family, given = arguments
    with pytest.raises(ValueError, match=message):
        family(**given)


@SMALL_MODELS
def test_a_few_sgd_steps_fit_a_small_batch(config):
    torch.manual_seed(0)
    model = small_model(config, image_size=16, num_classes=4)
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@SMALL_MODELS
def test_training_estimate_grows_with_batch_size_and_width(config):
    model = small_model(config)
    by_batch = [estimate_training_bytes(model, 32, batch, 0).total for batch in (1, 8, 64)]
    assert by_batch == sorted(set(by_batch))
    wider = small_model(config, width=2 * config[1]["width"])
    assert estimate_training_bytes(wider, 32, 8, 0).total > by_batch[1]


@SMALL_MODELS
def test_training_estimate_is_dominated_by_activations_at_large_batch(config):
    model = small_model(config)
    momentum = 4 * count_parameters(model)
    assert estimate_training_bytes(model, 32, 256, momentum).total > 10 * 3 * momentum  # weights, gradients too


class ConvReluLinear(torch.nn.Module):
    """conv (3 -> 2 channels, 3x3, same size), relu, flatten, linear (-> 5), on 4x4 images."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 2, 3, padding=1)
        self.linear = torch.nn.Linear(2 * 4 * 4, 5)

    def forward(self, images):
        return self.linear(torch.relu(self.conv(images)).flatten(1))


def test_training_estimate_counts_what_each_op_saves_for_backward_once_per_image():
    """Counted by hand, in float32 bytes: the conv keeps its input image (3x4x4) and its weight, relu its
    output (2x4x4), the linear its input (relu's output, flattened: the same storage) and its weight;
    the weights are state (parameters, gradients, the optimiser's momentum given), not activations. Weights counted as
    activations, a storage counted twice, or one image's activations not scaled by the batch, fails."""
    per_image = 4 * (3 * 4 * 4 + 2 * 4 * 4)
    parameter_bytes = 4 * ((2 * 3 * 3 * 3 + 2) + (2 * 4 * 4 * 5 + 5))
    momentum = parameter_bytes  # the optimiser's state, as given
    assert estimate_training_bytes(ConvReluLinear(), 4, 8, momentum) == (3 * parameter_bytes, 8 * per_image)
    assert kept_state_bytes(ConvReluLinear(), momentum) == 2 * parameter_bytes  # a copy keeps no gradients


def test_training_estimate_counts_what_only_training_saves():
    """Dropout after the relu keeps a mask per image in a training step (and its output, which the linear
    saves instead of relu's): counted as a step saves them. Measured in eval mode, dropout saved nothing,
    and a model with dropout was estimated at what it needs without."""
    with_dropout = torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3, padding=1), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                       torch.nn.Flatten(), torch.nn.Linear(2 * 4 * 4, 5))
    per_image = 4 * (3 * 4 * 4 + 2 * 4 * 4)  # as ConvReluLinear: the conv's input, relu's output
    mask = 4 * 2 * 4 * 4  # its scaled noise, a float per element (on a CPU)
    dropped = 4 * 2 * 4 * 4  # dropout's output, the linear's input
    assert estimate_training_bytes(with_dropout, 4, 8, 0).activations == 8 * (per_image + mask + dropped)


def test_training_estimate_leaves_modes_and_statistics_alone():
    model = small_model(SMALL_DENSENET).train()
    frozen_norm = model.features[1].new_features[0].eval()
    statistics = {name: buffer.clone() for name, buffer in model.named_buffers()}
    estimate_training_bytes(model, 32, 4, 0)
    assert model.training and not frozen_norm.training
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, statistics[name]), name
