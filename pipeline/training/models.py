"""The built-in model families, in plain torch: ResNet and DenseNet-BC, declared as
`pipeline.training.models.resnet` and `.densenet` (pipeline/training/members.py).

Both take normalised float NCHW images (channels_last works too) and return
logits of shape [N, num_classes].

Stem: images of CIFAR's size (up to 32 px) keep their full resolution
through a 3x3 stride-1 conv, as in the CIFAR variants of both papers. Larger
ones go through the ImageNet stem (7x7 stride-2 conv + 3x3 stride-2 max pool),
which reduces them 4x at once: at 48-64 px a full-resolution stem would cost
10-16x the compute (a DenseNet-40 step on a batch of 32 takes 2-4 s on one
core instead of 0.2-0.3 s).
The default, ``image_size=224``, selects the ImageNet stem, which runs on
inputs down to 32 px (stage 1 then sees 8x8), so a model built without an
image size still works at any size the pipeline produces.
"""

import itertools
from typing import NamedTuple

import torch
from torch import nn

SMALL_IMAGE_PX = 32  # up to this size (CIFAR's), the full-resolution stem

# ResNet depth -> BasicBlocks per stage (He et al. 2016, table 1);
# depth = 2 + 2 * sum(blocks): the stem conv, two convs per block, the classifier.
RESNET_BLOCKS = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}

# DenseNet-BC depth -> bottleneck layers per dense block (Huang et al. 2017).
# The ImageNet configurations are fixed; any other depth with
# (depth - 4) % 6 == 0 gives the CIFAR layout: 3 blocks of (depth - 4) / 6
# layers of two convs each, plus stem conv, 2 transitions and classifier.
DENSENET_IMAGENET_BLOCKS = {
    121: (6, 12, 24, 16),
    169: (6, 12, 32, 32),
    201: (6, 12, 48, 32),
    264: (6, 12, 64, 48),
}
BOTTLENECK_FACTOR = 4  # the 1x1 conv of a dense layer makes 4k channels
COMPRESSION = 0.5  # transitions halve the number of channels


def resnet(depth: int = 18, width: int = 64, num_classes: int = 1000, image_size: int = 224) -> nn.Module:
    """An untrained ResNet (He et al. 2016) of BasicBlocks.

    depth: layers, as in its name: 10, 18 or 34.
    width: channels of stage 1 (stages have w, 2w, 4w, 8w); 64 in the paper.
    image_size: side of the input images in px; picks the stem (module doc).
    """
    _require_positive_ints(width=width, num_classes=num_classes, image_size=image_size)
    return ResNet(_resnet_blocks(depth), width, num_classes, image_size)


def densenet(depth: int = 121, growth_rate: int = 32, width: int = 64, num_classes: int = 1000,
             image_size: int = 224) -> nn.Module:
    """An untrained DenseNet-BC (Huang et al. 2017).

    depth: layers, as in its name: 121, 169, 201, 264, or 4 + 6n for the CIFAR layout (40, 64, 100, ...).
    growth_rate: k, channels each dense layer adds.
    width: channels of the stem (the paper uses 2k).
    image_size: side of the input images in px; picks the stem (module doc).
    """
    _require_positive_ints(width=width, growth_rate=growth_rate, num_classes=num_classes, image_size=image_size)
    return DenseNet(_densenet_blocks(depth), growth_rate, width, num_classes, image_size)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def describe(model: nn.Module) -> str:
    """One line for logs and reports, e.g. "resnet10 w16: 0.31M params"."""
    name = getattr(model, "name", type(model).__name__)
    return f"{name}: {count_parameters(model) / 1e6:.2f}M params"


class TrainingBytes(NamedTuple):
    """What a training step holds, in two parts: a group's members keep their states together but,
    stepped in turn, hold one member's activations at a time (a fused array: all its members' at once)."""

    state: int  # parameters, their gradients, the optimiser's state, other buffers
    activations: int  # saved for backward, for the whole batch

    @property
    def total(self) -> int:
        return self.state + self.activations


def estimate_training_bytes(model: nn.Module, image_size: int, batch_size: int,
                            optimizer_state_bytes: int) -> TrainingBytes:
    """Estimate the memory one training step of any module holds.

    Counts parameters, their gradients, the optimiser's state (given: what
    pipeline.training.members.optimizer_state_bytes counts), the module's
    other buffers, and the activations autograd saves for backward. Those are
    measured exactly per image, by a training forward pass of two images that
    records every tensor saved for backward (each storage once), and scaled by
    batch_size.
    It is an estimate of the retained memory, so a lower bound of the peak:
    it leaves out the transient gradients and buffers of the backward pass,
    workspaces (cuDNN, oneDNN) and allocator slack: on CPU, the peak resident
    memory of a step measured 1.2-2.8x the estimate. Plan with headroom.
    """
    _require_positive_ints(image_size=image_size, batch_size=batch_size)
    gradients = _nbytes(p for p in model.parameters() if p.requires_grad)
    return TrainingBytes(gradients + kept_state_bytes(model, optimizer_state_bytes),
                         batch_size * _saved_activation_bytes_per_image(model, image_size))


def kept_state_bytes(model: nn.Module, optimizer_state_bytes: int) -> int:
    """What a copy of the module's state holds: its parameters, buffers and the optimiser's state (given),
    no gradients. A trainer keeps one at each epoch's end (pipeline/training/group.KeptStates)."""
    return _nbytes(model.parameters()) + optimizer_state_bytes + _nbytes(model.buffers())


def estimate_step_flops(model: nn.Module, image_size: int) -> float:
    """Multiply-adds of one image's training step (forward + backward, about 3x the
    forward's convolutions and matmuls): the cost used to balance slots when no
    rate was measured. A count, not a time: only ratios between models matter."""
    _require_positive_ints(image_size=image_size)
    total = 0

    def count(module: nn.Module, _, output: torch.Tensor) -> None:
        nonlocal total
        spatial = output[0, 0].numel() if output.dim() == 4 else 1  # output pixels per channel
        total += module.weight.numel() * spatial

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.no_grad():
            _forward(model, image_size)
    finally:
        for hook in hooks:
            hook.remove()
    return 3.0 * total


def _saved_activation_bytes_per_image(model: nn.Module, image_size: int) -> int:
    state = itertools.chain(model.parameters(), model.buffers())
    state_storages = {tensor.untyped_storage().data_ptr() for tensor in state}
    # By address, so that a tensor saved by several ops counts once; holding
    # the storages keeps their addresses from being reused while we count.
    saved_storages = {}

    def record(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in state_storages:
            saved_storages[storage.data_ptr()] = storage
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        _forward(model, image_size, TRAINING_IMAGES, training=True)
    return sum(storage.nbytes() for storage in saved_storages.values()) // TRAINING_IMAGES


TRAINING_IMAGES = 2  # the fewest batch norm can train on where a feature map is 1x1


def _forward(model: nn.Module, image_size: int, images: int = 1, training: bool = False) -> None:
    """`images` zero images through `model`, where its parameters are: in eval mode, or in training mode as a
    step runs, saving for backward what it saves (dropout's masks too). Every module's mode and every buffer
    (batch norm's running statistics) are left as they were found."""
    first_parameter = next(model.parameters())
    batch = torch.zeros(images, 3, image_size, image_size, dtype=first_parameter.dtype, device=first_parameter.device)
    buffers = [(buffer, buffer.clone()) for buffer in model.buffers()]
    modes = {module: module.training for module in model.modules()}
    try:
        model.train(training)
        model(batch)
    finally:
        for module, was in modes.items():
            module.training = was
        with torch.no_grad():
            for buffer, kept in buffers:
                buffer.copy_(kept)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _require_positive_ints(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")


def _resnet_blocks(depth: int) -> tuple[int, ...]:
    if depth not in RESNET_BLOCKS:
        valid = ", ".join(map(str, RESNET_BLOCKS))
        raise ValueError(f"resnet depth must be one of {valid}; got {depth!r}")
    return RESNET_BLOCKS[depth]


def _densenet_blocks(depth: int) -> tuple[int, ...]:
    if depth in DENSENET_IMAGENET_BLOCKS:
        return DENSENET_IMAGENET_BLOCKS[depth]
    if isinstance(depth, int) and depth >= 10 and (depth - 4) % 6 == 0:
        return ((depth - 4) // 6,) * 3
    imagenet = ", ".join(map(str, DENSENET_IMAGENET_BLOCKS))
    raise ValueError(
        f"densenet depth must be {imagenet}, or 4 + 6n with n >= 1 for the "
        f"CIFAR layout (10, 16, 22, 28, 34, 40, ..., 100, ..., 190); got {depth!r}"
    )


def _stem(out_channels: int, image_size: int) -> nn.Sequential:
    if image_size <= SMALL_IMAGE_PX:
        return nn.Sequential(_conv(3, out_channels, 3), nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))
    return nn.Sequential(
        _conv(3, out_channels, 7, stride=2),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    )


def _conv(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> nn.Conv2d:
    # No bias: every conv here feeds a batch-norm, whose shift replaces it.
    return nn.Conv2d(
        in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2, bias=False
    )


def _init_weights(model: nn.Module) -> None:
    # He init, as both papers use: PyTorch's default conv init starts ReLU nets too small.
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)


class BasicBlock(nn.Module):
    """Two 3x3 convs and a shortcut, projected by a 1x1 conv where the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.residual = nn.Sequential(
            _conv(in_channels, out_channels, 3, stride),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            _conv(out_channels, out_channels, 3),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                _conv(in_channels, out_channels, 1, stride), nn.BatchNorm2d(out_channels)
            )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.residual(x) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, blocks_per_stage: tuple[int, ...], width: int, num_classes: int, image_size: int):
        super().__init__()
        self.name = f"resnet{2 + 2 * sum(blocks_per_stage)} w{width}"
        layers = [_stem(width, image_size)]
        in_channels = width
        for stage, num_blocks in enumerate(blocks_per_stage):
            out_channels = width * 2**stage
            for block in range(num_blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(in_channels, out_channels, stride))
                in_channels = out_channels
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(in_channels, num_classes)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv (4k) - BN-ReLU-3x3 conv (k); its k channels join the block's input."""

    members: int = 1  # models computed at once; pipeline/training/fusion.py sets it in a fused array

    def __init__(self, in_channels: int, growth_rate: int):
        super().__init__()
        bottleneck = BOTTLENECK_FACTOR * growth_rate
        self.new_features = nn.Sequential(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=True),
            _conv(in_channels, bottleneck, 1),
            nn.BatchNorm2d(bottleneck),
            nn.ReLU(inplace=True),
            _conv(bottleneck, growth_rate, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _concat_channels(x, self.new_features(x), self.members)


def _concat_channels(x: torch.Tensor, new: torch.Tensor, members: int) -> torch.Tensor:
    """torch.cat([x, new], dim=1), keeping each member's channels together in a fused array."""
    if members == 1:
        return torch.cat([x, new], dim=1)
    if x.is_contiguous():  # NCHW (CPU slots): the result stays NCHW
        return torch.cat([x.unflatten(1, (members, -1)), new.unflatten(1, (members, -1))], dim=2).flatten(1, 2)
    # channels_last (GPU slots): concatenated with channels as the last dim, so that the result stays channels_last
    x, new = (t.movedim(1, -1).unflatten(-1, (members, -1)) for t in (x, new))
    return torch.cat([x, new], dim=-1).flatten(-2).movedim(-1, 1)


class Transition(nn.Sequential):
    """BN-ReLU-1x1 conv that compresses the channels, then 2x2 average pooling."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=True),
            _conv(in_channels, out_channels, 1),
            nn.AvgPool2d(2),
        )


class DenseNet(nn.Module):
    def __init__(
        self,
        layers_per_block: tuple[int, ...],
        growth_rate: int,
        stem_channels: int,
        num_classes: int,
        image_size: int,
    ):
        super().__init__()
        # stem conv + two convs per dense layer + transitions + classifier
        depth = 1 + 2 * sum(layers_per_block) + (len(layers_per_block) - 1) + 1
        self.name = f"densenet{depth} k{growth_rate} w{stem_channels}"
        layers = [_stem(stem_channels, image_size)]
        channels = stem_channels
        for block, num_layers in enumerate(layers_per_block):
            for _ in range(num_layers):
                layers.append(DenseLayer(channels, growth_rate))
                channels += growth_rate
            if block < len(layers_per_block) - 1:
                compressed = int(channels * COMPRESSION)
                layers.append(Transition(channels, compressed))
                channels = compressed
        layers += [nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))
