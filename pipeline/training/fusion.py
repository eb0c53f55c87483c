"""Horizontally fused arrays (HFTA, Wang et al. 2021): k models of one
architecture trained as one module, so a step launches each kernel once for
all k instead of k times (small models leave most of a GPU idle).

Layout: member-major everywhere. The fused module has the plain model's
module tree and state-dict names; each of its tensors holds the members'
tensors one after another, so `t.view(k, *plain_shape)[i]` is member i's.
That one rule fuses, unfuses, drops a member and reads its checkpoint.
Batch-norm's num_batches_tracked, a scalar, is shared (it counts the array's
steps; the fixed BN momentum means no member's statistics depend on it).
- A conv becomes a grouped conv with k groups: member i's output channels see
  only member i's input channels. The first conv sees the images, the same
  for every member: it is one ordinary conv 3 -> k*C_out on them, not a
  grouped one on k copies of the batch.
- BatchNorm2d(k*C) is per-member batch norm: its statistics are per channel.
- The classifier is a batched matmul: [N, k*in] -> logits [k, N, classes].
- DenseLayer concatenates per member (models.DenseLayer.members).
One FusedSGD step updates every member with its own lr, momentum and weight
decay, held as [k] tensors that broadcast over each parameter viewed [k, ...].
The param group's "lr" scales all members' lrs, so LR schedulers and GradScaler
work on it unchanged.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.training.models import DenseLayer


class FusedLinear(nn.Module):
    """k Linear(in, out) as one batched matmul: [N, k*in] -> [k, N, out]."""

    def __init__(self, members: int, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.members = members
        self.weight = nn.Parameter(torch.empty(members, out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(members, out_features, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unflatten(1, (self.members, -1)).transpose(0, 1)  # [k, N, in]
        return torch.baddbmm(self.bias.unsqueeze(1), x, self.weight.transpose(1, 2))


class FusedSGD(torch.optim.Optimizer):
    """torch.optim.SGD(nesterov=True) for a fused array's parameters, with each
    member's own lr, momentum and weight decay; the group's "lr" is a scale on
    the members' lrs (1.0 at start)."""

    def __init__(self, params, lrs: list[float], momenta: list[float], weight_decays: list[float]):
        params = list(params)
        device = params[0].device

        def per_member(values):  # float64 holds the given floats exactly (checkpoints show them as given)
            return torch.tensor(values, dtype=torch.float64, device=device)

        # "lr" a tensor: the schedule fills it, and a CUDA graph of the step reads it (training/graphs.py)
        scale = torch.tensor(1.0, dtype=torch.float64, device=device)
        super().__init__(params, {"lr": scale, "lrs": per_member(lrs), "momenta": per_member(momenta),
                                  "weight_decays": per_member(weight_decays)})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            dtype, members = params[0].dtype, len(group["lrs"])
            lrs = (group["lr"] * group["lrs"]).to(dtype)
            momenta, weight_decays = group["momenta"].to(dtype), group["weight_decays"].to(dtype)
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)  # zeros then + d: SGD's first buffer, d
                shape = (members,) + (1,) * p.dim()  # broadcasts over p viewed [k, ...]
                param, grad = p.unflatten(0, (members, -1)), p.grad.unflatten(0, (members, -1))
                buffer = state["momentum_buffer"].unflatten(0, (members, -1))
                d = torch.addcmul(grad, weight_decays.view(shape), param)
                buffer.mul_(momenta.view(shape)).add_(d)
                d.addcmul_(momenta.view(shape), buffer)
                param.addcmul_(lrs.view(shape), d, value=-1)
        return loss

    def keep_members(self, kept: list[int], params) -> None:
        """Go on with only the members `kept` (in that order), whose parameters are
        now `params` (the rebuilt module's, in the same order). The same optimiser
        object, so an LR scheduler or GradScaler bound to it carries on."""
        (group,) = self.param_groups
        members, params = len(group["lrs"]), list(params)
        index = torch.tensor(kept, device=group["lrs"].device)
        state = defaultdict(dict)
        for old, new in zip(group["params"], params):
            if "momentum_buffer" in self.state.get(old, {}):
                kept_buffer = self.state[old]["momentum_buffer"].unflatten(0, (members, -1))[index].flatten(0, 1)
                state[new]["momentum_buffer"] = torch.empty_like(new).copy_(kept_buffer)  # new's memory format
        self.state = state
        group["params"] = params
        for key in ("lrs", "momenta", "weight_decays"):
            group[key] = group[key][index]


@dataclass(frozen=True)
class ArrayStates:
    """A fused array's tensors and hyper-parameters at one moment (FusedArray.states), from which each member's
    plain checkpoint is built when it is wanted (`member`)."""

    plain: nn.Module  # the architecture, on the meta device
    shapes: dict[str, torch.Size]  # a member's tensor of each state-dict name
    model: dict[str, torch.Tensor]  # the fused module's state dict
    buffers: dict[int, tuple[str, torch.Tensor]]  # plain parameter index -> (its name, its fused momentum buffer)
    scale: float  # the param group's "lr": the schedule's factor on each member's rate
    initial: float | None  # its "initial_lr", set by an LR scheduler: the rate the schedule's factors multiply
    lrs: list[float]
    momenta: list[float]
    weight_decays: list[float]

    def copied(self, copy_tensor) -> ArrayStates:
        """These states with each tensor `copy_tensor(tensor)`: one copy per fused tensor (a trainer's copy at
        an epoch's end: a few thousand copies for 100 members, not one per member's tensor)."""
        return replace(self, model={name: copy_tensor(t) for name, t in self.model.items()},
                       buffers={index: (name, copy_tensor(t)) for index, (name, t) in self.buffers.items()})

    def member(self, i: int) -> dict:
        """Member i as a plain model's checkpoint: {"model": its state dict, "optimizer": torch.optim.SGD's
        state dict for it}; both load without the array."""
        lr = self.lrs[i]
        plain_optimizer = torch.optim.SGD(self.plain.parameters(), lr=self.scale * lr, momentum=self.momenta[i],
                                          weight_decay=self.weight_decays[i], nesterov=True).state_dict()
        if self.initial is not None:
            plain_optimizer["param_groups"][0]["initial_lr"] = self.initial * lr
        for index, (name, buffer) in self.buffers.items():
            plain_optimizer["state"][index] = {"momentum_buffer": _member_view(buffer, self.shapes[name], i).clone()}
        # Clones: a view would keep (and torch.save would write) every member's storage.
        model = {name: (t if t.dim() == 0 else _member_view(t, self.shapes[name], i)).clone()
                 for name, t in self.model.items()}
        return {"model": model, "optimizer": plain_optimizer}


class FusedArray:
    """k models of one architecture trained as one horizontally fused module,
    each with its own SGD hyper-parameters.

    The plain models' current weights (on their device, in their memory format)
    become the members'; the plain models can be dropped after. Member i is
    the i-th model given, and after `drop(j)` the members after j move down one.
    """

    def __init__(self, models: list[nn.Module], lrs: list[float], momenta: list[float],
                 weight_decays: list[float]):
        if not models or not len(models) == len(lrs) == len(momenta) == len(weight_decays):
            raise ValueError("a fused array needs one or more models, with one lr, momentum and weight decay each")
        self.members = len(models)
        self._plain = copy.deepcopy(models[0]).to("meta")  # the architecture, without its memory
        self._plain_shapes = {name: t.shape for name, t in self._plain.state_dict().items()}
        states = [model.state_dict() for model in models]
        for state in states:
            self._check_plain_state(state)
        self.module = self._build(self.members, next(models[0].parameters()).device, _memory_format(models[0]))
        with torch.no_grad():
            for i, state in enumerate(states):
                self._write_member(i, state)
            for name, t in self.module.state_dict().items():
                if t.dim() == 0:
                    t.copy_(states[0][name])
        self.optimizer = FusedSGD([p for _, p in self._named_parameters()], lrs, momenta, weight_decays)

    def losses(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each member's mean cross-entropy, shape [k]. Members share no weights, so
        backpropagating the sum gives each member exactly its own gradient."""
        per_image = F.cross_entropy(logits.flatten(0, 1), y.repeat(self.members), reduction="none")
        return per_image.view(self.members, -1).mean(1)

    def member_state(self, i: int) -> dict:
        """Member i as a plain model's checkpoint (ArrayStates.member), from the array's live tensors."""
        return self.states().member(i)

    def states(self) -> ArrayStates:
        """The array's live tensors and its hyper-parameters now, every member's checkpoint in them."""
        group = self.optimizer.param_groups[0]
        buffers = {index: (name, self.optimizer.state[p]["momentum_buffer"])
                   for index, (name, p) in enumerate(self._named_parameters())
                   if "momentum_buffer" in self.optimizer.state.get(p, {})}
        model = self.module.state_dict()
        return ArrayStates(self._plain, self._plain_shapes, model, buffers, float(group["lr"]),
                           float(group["initial_lr"]) if "initial_lr" in group else None,
                           group["lrs"].tolist(), group["momenta"].tolist(), group["weight_decays"].tolist())

    def load_member_state(self, i: int, state: dict) -> None:
        """Member i resumes from `state` (a `member_state`, or a plain model's and its
        Nesterov SGD's state dicts). Its lr is the base rate that the array's scale
        multiplies: the state's initial_lr (set by an LR scheduler), else its lr."""
        self._check_plain_state(state["model"])
        (saved_group,) = state["optimizer"]["param_groups"]
        if not saved_group["nesterov"] or saved_group["dampening"] or saved_group.get("maximize"):
            raise ValueError("only a Nesterov SGD state without dampening continues in a fused array")
        group = self.optimizer.param_groups[0]
        group["lrs"][i] = saved_group.get("initial_lr", saved_group["lr"])
        group["momenta"][i] = saved_group["momentum"]
        group["weight_decays"][i] = saved_group["weight_decay"]
        with torch.no_grad():
            self._write_member(i, state["model"])
            for index, (name, p) in enumerate(self._named_parameters()):
                saved = state["optimizer"]["state"].get(index, {}).get("momentum_buffer")
                fused_state = self.optimizer.state[p]
                if saved is None and "momentum_buffer" not in fused_state:
                    continue
                if "momentum_buffer" not in fused_state:
                    fused_state["momentum_buffer"] = torch.zeros_like(p)  # a zero buffer is no buffer yet
                member_buffer = _member_view(fused_state["momentum_buffer"], self._plain_shapes[name], i)
                if saved is None:
                    member_buffer.zero_()
                else:
                    member_buffer.copy_(saved)

    def drop(self, i: int) -> None:
        """Member i leaves: the module is rebuilt with the others (their weights,
        BN statistics and momentum unchanged) and the optimiser goes on with them,
        so nothing holds member i's memory any more."""
        if self.members == 1:
            raise ValueError("the last member of a fused array cannot leave it")
        kept = [j for j in range(self.members) if j != i]
        old = self.module
        first_weight = next(old.parameters())
        self.module = self._build(len(kept), first_weight.device, _memory_format(old))
        self.module.train(old.training)
        old_state = old.state_dict()
        with torch.no_grad():
            for name, t in self.module.state_dict().items():
                if t.dim() == 0:
                    t.copy_(old_state[name])
                else:
                    shape = self._plain_shapes[name]
                    t.view(len(kept), *shape).copy_(old_state[name].view(self.members, *shape)[kept])
        self.members = len(kept)
        self.optimizer.keep_members(kept, [p for _, p in self._named_parameters()])

    def _build(self, members: int, device, memory_format) -> nn.Module:
        """The fused module for `members` models, its tensors not yet written."""
        return _fused_structure(self._plain, members).to_empty(device=device).to(memory_format=memory_format)

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The fused parameters in the plain model's order: optimiser state index j is the plain j-th."""
        params = dict(self.module.named_parameters())
        return [(name, params[name]) for name, _ in self._plain.named_parameters()]

    def _write_member(self, i: int, plain_state: dict) -> None:
        for name, t in self.module.state_dict().items():
            if t.dim():
                _member_view(t, self._plain_shapes[name], i).copy_(plain_state[name])

    def _check_plain_state(self, state: dict) -> None:
        if {name: t.shape for name, t in state.items()} != self._plain_shapes:
            raise ValueError("a model's state does not match the fused array's architecture (names or shapes differ)")


def _member_view(t: torch.Tensor, shape: torch.Size, i: int) -> torch.Tensor:
    """Member i's tensor of the plain `shape` in the fused tensor `t` (member-major: the module's docstring)."""
    return t.view(-1, *shape)[i]


def _fused_structure(plain: nn.Module, members: int) -> nn.Module:
    """`plain` (on the meta device) with each layer replaced by its fused form, names and dtype unchanged."""
    fused = copy.deepcopy(plain)
    factory = {"device": "meta", "dtype": next(plain.parameters()).dtype}
    first_conv = next(m for m in fused.modules() if isinstance(m, nn.Conv2d))
    for parent in list(fused.modules()):
        if isinstance(parent, DenseLayer):
            parent.members = members
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Conv2d):
                setattr(parent, name, _fused_conv(child, members, child is first_conv, factory))
            elif isinstance(child, nn.BatchNorm2d):
                setattr(parent, name, nn.BatchNorm2d(members * child.num_features, child.eps, child.momentum,
                                                     child.affine, child.track_running_stats, **factory))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, FusedLinear(members, child.in_features, child.out_features, **factory))
            elif list(child.parameters(recurse=False)) or list(child.buffers(recurse=False)):
                raise TypeError(f"cannot fuse {type(child).__name__}: only Conv2d, BatchNorm2d and Linear hold state")
    return fused


def _fused_conv(conv: nn.Conv2d, members: int, shares_input: bool, factory: dict) -> nn.Conv2d:
    if shares_input:  # every member sees the same images: one ordinary conv, 3 -> k*C_out
        in_channels, groups = conv.in_channels, 1
    else:
        in_channels, groups = members * conv.in_channels, members * conv.groups
    return nn.Conv2d(in_channels, members * conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                     conv.dilation, groups, conv.bias is not None, conv.padding_mode, **factory)


def _memory_format(module: nn.Module) -> torch.memory_format:
    """channels_last if the module's convs are (the group's layout), so that a fused module keeps it."""
    first_weight = next(m.weight for m in module.modules() if isinstance(m, nn.Conv2d))
    return torch.contiguous_format if first_weight.is_contiguous() else torch.channels_last
