"""An ensemble member as the user declares it, and what it builds.

A member names its module, optimiser, learning-rate schedule and loss as Hydra
`_target_` configs (pipeline/conf/ensemble/, docs/configuration.md). The project calls
each with what only it knows:

- model: `num_classes=` the dataset's class count, unless the config sets it,
  and `image_size=` its sink's image side where the callable names such a
  parameter;
- optimizer: the module's parameters, first (`_partial_` is optional);
- lr_scheduler: the optimiser, first, and `total_steps=` the steps of the
  whole run where the callable names such a parameter; it steps after every
  training step, or, one whose step() takes a metric (ReduceLROnPlateau),
  once an epoch after validation, on the member's validation loss;
- loss: nothing; the module it makes is called with (logits, labels).

Each member's initial weights come from its own `seed`, so members that
differ only in hyper-parameters still start apart (the diversity an
ensemble gains from different initialisations), and a member starts the same
in any group, fused or not. Everything is imported where it is built: in
the process that trains the member, on its host, and in the driver, which
builds every member once before a run starts (`check_members`, and the
memory estimate).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import math
import re
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.runtime.errors import UserError

# What HFTA's operator fusion (pipeline/training/fusion.py) covers: the built-in families, stepped by Nesterov SGD
# (each member's lr, momentum, weight decay its own) on the cosine schedule with cross-entropy. Other members of one
# family fuse by vmap (pipeline/training/stacked.py).
HFTA_MODELS = ("pipeline.training.models.resnet", "pipeline.training.models.densenet")
HFTA_OPTIMIZER = "torch.optim.SGD"
HFTA_OPTIMIZER_KEYS = {"_target_", "_partial_", "lr", "momentum", "weight_decay", "nesterov"}
COSINE = "pipeline.training.members.cosine"
COSINE_KEYS = {"_target_", "warmup_fraction"}  # what HFTA's array steps for its members (one schedule for all)
CROSS_ENTROPY = "torch.nn.CrossEntropyLoss"
VMAP_NO_AUTOCAST = ("vmap applies no autocast: fused by it, a member would train in fp32, not in "
                    "trainer.precision's dtype as it does packed")
HFTA_ONE_SCALER = ("trainer.precision=fp16: an array has one gradient scaler, and one member's overflow would skip "
                   "every member's step")
CONF = Path(__file__).resolve().parents[1] / "conf"  # the shipped config tree: its presets are the defaults


class MemberError(UserError):
    """A member's declaration that cannot be built or trained: names the member, the key and the fix."""

    def __init__(self, message: str, member: str, reason: str):
        super().__init__(message)
        self.member = member  # its name
        self.reason = reason  # the user's code's own error, alone


@dataclass(frozen=True)
class ModelSpec:
    """One member: each config a `_target_` dict, resolved (plain Python values)."""

    name: str
    input: str  # the sink (a broadcast stage) it trains on
    model: dict
    optimizer: dict
    lr_scheduler: dict
    loss: dict
    seed: int  # of its initial weights
    slots: int = 1  # data-parallel over this many slots when > 1
    unfusable: str | None = None  # why vmap cannot fuse its module (check_members finds it); None: it can

    @property
    def shape(self) -> str:
        """What it computes, per image: its module on its sink. Members of one shape weigh the same."""
        return canonical([self.model, self.input])

    @property
    def family(self) -> str:
        """Members of one family (one module config, sink and loss) differ only in what each steps on its
        own (optimiser, schedule, seed, so weights): they fuse, unless vmap rejects their module."""
        return canonical([self.model, self.input, self.loss])

    @property
    def fuses_with(self) -> str:
        """The key of the members it may share a fused array with: its family, or none where it cannot fuse."""
        return canonical([self.family, self.name]) if self.unfusable else self.family

    @property
    def optimizer_kind(self) -> str:
        """Its optimiser as far as memory and speed go: the target and every setting, numbers told only zero
        or not (SGD's momentum 0 keeps no buffer; a learning rate or weight decay changes neither)."""
        return canonical(_zero_or_not(self.optimizer))

    @property
    def fusion(self) -> str:
        """How it fuses: "hfta", the built-in families' operator fusion (pipeline/training/fusion.py; an
        array all of whose members take it), else "vmap" (any module, pipeline/training/stacked.py)."""
        optimizer = self.optimizer
        if (self.model["_target_"] in HFTA_MODELS and optimizer["_target_"] == HFTA_OPTIMIZER
                and set(optimizer) <= HFTA_OPTIMIZER_KEYS and optimizer.get("nesterov")
                and self.schedule["_target_"] == COSINE and set(self.schedule) <= COSINE_KEYS
                and self.loss == {"_target_": CROSS_ENTROPY}):
            return "hfta"
        return "vmap"

    @property
    def schedule(self) -> dict:
        """Its learning-rate schedule's config as it decides the rates (`_partial_` aside)."""
        return {key: value for key, value in self.lr_scheduler.items() if key != "_partial_"}

    def describe(self) -> str:
        """E.g. "resnet(depth=10, width=16)"."""
        return _call(self.model)


def with_defaults(name: str, model: dict, input: str = "main", seed: int = 0, slots: int = 1,
                  **optimizer) -> ModelSpec:
    """A member as an ensemble file declares one with the shipped defaults (pipeline/conf/config.yaml's: SGD,
    cosine, cross-entropy), `optimizer`'s keys over SGD's: how scripts and tests declare members in code."""
    from omegaconf import OmegaConf

    def preset(group: str, choice: str) -> dict:
        return OmegaConf.to_container(OmegaConf.load(CONF / group / f"{choice}.yaml"))

    return ModelSpec(name, input, model, {**preset("optimizer", "sgd"), **optimizer},
                     preset("lr_scheduler", "cosine"), preset("loss", "cross_entropy"), seed, slots)


def array_fusion(unit) -> str:
    """How an array of these members fuses: "hfta" where every member takes it and their schedule is one (the
    array steps one; GroupSpec.units puts members of one schedule together), else "vmap"."""
    one_schedule = len({canonical(m.schedule) for m in unit}) == 1
    return "hfta" if one_schedule and all(m.fusion == "hfta" for m in unit) else "vmap"


def grouped(models, key) -> dict[str, list[ModelSpec]]:
    """Members by `key(member)` (e.g. its family or shape), in the order given."""
    groups: dict[str, list[ModelSpec]] = {}
    for m in models:
        groups.setdefault(key(m), []).append(m)
    return groups


def member_seed(run_seed: int, name: str) -> int:
    """A member's default seed: from the run's seed and its name, the same on every host and run."""
    return zlib.crc32(f"{run_seed}/{name}".encode())


def cosine(optimizer, total_steps: int, warmup_fraction: float = 0.0):
    """The default schedule: cosine annealing of every rate to 0 over the run's steps, after a linear warm-up
    over their first `warmup_fraction` (from 1/(w + 1) of the rate over its w steps, to the rate)."""
    import torch

    if not 0 <= warmup_fraction < 1:
        raise ValueError(f"warmup_fraction is the share of the run's steps that warm up: in [0, 1), got "
                         f"{warmup_fraction}")
    total = max(1, total_steps)
    warmup = int(warmup_fraction * total)  # (below total: the cosine has a step)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total - warmup) / (total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_module(m: ModelSpec, num_classes: int, image_size: int):
    """The member's untrained module, on the CPU, from its own seed."""
    import torch

    with _declared(m, "model"):
        target = target_of(m.model)
        given = {}
        if "num_classes" not in m.model and _accepts(target, "num_classes", by_kwargs=True):
            given["num_classes"] = num_classes
        if "image_size" not in m.model and _accepts(target, "image_size"):
            given["image_size"] = image_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(m.seed)
            try:
                module = _instantiate(m.model, **given)
            except Exception as err:
                # offered through **kwargs, which do not all take it (MONAI's DenseNet121 hands them to a class
                # that counts classes as out_channels): the callable is called as it was declared
                if "num_classes" not in given or not _refused_keyword(err, "num_classes"):
                    raise
                del given["num_classes"]
                torch.manual_seed(m.seed)
                module = _instantiate(m.model, **given)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"it returned a {type(module).__name__}, not a torch.nn.Module")
    return module


def build_optimizer(m: ModelSpec, params, **given):
    """The member's optimiser over `params`; `given` adds arguments (a device's own, e.g. fused=True)."""
    import torch

    with _declared(m, "optimizer"):
        optimizer = _instantiate(m.optimizer, params, **given)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"it returned a {type(optimizer).__name__}, not a torch.optim.Optimizer")
    return optimizer


def optimizer_state_bytes(m: ModelSpec, module) -> int:
    """Bytes of the state the member's optimiser keeps for `module`'s trained parameters (SGD's momentum: one
    buffer a parameter; Adam's: two; none for SGD without momentum), counted after one step on stand-ins of
    the parameters: on the meta device (no memory, no compute), else on the CPU (an optimiser that reads
    values, e.g. Adagrad)."""
    import torch

    trained = [p for p in module.parameters() if p.requires_grad]
    for device in ("meta", "cpu"):
        stand_ins = [torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device)) for p in trained]
        for p in stand_ins:
            p.grad = torch.zeros_like(p)
        optimizer = build_optimizer(m, stand_ins)
        try:
            with _declared(m, "optimizer"):
                optimizer.step()
        except MemberError:
            if device == "cpu":
                raise
            continue
        return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0)  # not a step count


def build_schedule(m: ModelSpec, optimizer, total_steps: int):
    """The member's learning-rate schedule on `optimizer`."""
    import torch

    with _declared(m, "lr_scheduler"):
        given = {"total_steps": total_steps} if _accepts(target_of(m.lr_scheduler), "total_steps") else {}
        schedule = _instantiate(m.lr_scheduler, optimizer, **given)
        if not isinstance(schedule, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(f"it returned a {type(schedule).__name__}, not a torch.optim.lr_scheduler.LRScheduler")
    return schedule


def steps_on_metric(schedule) -> bool:
    """Whether `schedule` steps on a metric (ReduceLROnPlateau's step(metrics)): such a schedule is stepped
    once an epoch, after validation, on its member's validation loss; every other one after every training
    step, with no argument."""
    return bool(_needs(type(schedule)))


@functools.cache
def _needs(schedule_type) -> tuple[str, ...]:
    """The arguments a schedule's step() cannot do without (once per class: it is asked every step)."""
    return tuple(p.name for p in list(inspect.signature(schedule_type.step).parameters.values())[1:]
                 if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _step_as_training_does(schedule) -> None:
    """One step of `schedule` as training steps it: with no argument, or with a validation loss where it steps
    on a metric. One that needs more, or that takes its metric as one to maximise, is refused, saying why."""
    needs = _needs(type(schedule))
    if len(needs) > 1:
        raise TypeError(f"its step() needs {', '.join(needs)}, but a member's schedule is stepped after every "
                        "training step with no argument, or once an epoch with the member's validation loss; "
                        "declare one that counts steps (torch.optim.lr_scheduler.StepLR, OneCycleLR, the "
                        "built-in cosine) or one that steps on a metric (ReduceLROnPlateau)")
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    if isinstance(schedule, ReduceLROnPlateau) and schedule.mode != "min":
        raise ValueError(f"mode={schedule.mode!r}, but it is stepped on the member's validation loss, which falls "
                         "as the member improves: give mode: min (the default)")
    with warnings.catch_warnings():  # (no optimiser step comes first here, as one does in training)
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        schedule.step(*[1.0] * len(needs))


def build_loss(m: ModelSpec):
    """The member's loss module: (logits, labels) -> a 0-d mean loss."""
    with _declared(m, "loss"):
        loss = _instantiate(m.loss)
        if not callable(loss):
            raise TypeError(f"it returned a {type(loss).__name__}, which cannot be called")
    return loss


def check_members(members: list[ModelSpec], num_classes: int, image_sizes: dict[str, int],
                  total_steps: int, precision: str = "fp32") -> list[ModelSpec]:
    """Build each member's declaration, dry, before a run starts anything: its module and one forward of two
    images, whose logits must be [2, num_classes] (once per shape); its optimiser, schedule (over the run's
    `total_steps`, stepped once) and loss on them.
    On the meta device (shapes only: no memory, no compute); a module that cannot run there (an op that
    reads values) is tried on the CPU, whose error is the one that counts. Raises a MemberError naming
    the member and key. Returns the members, each marked `unfusable` where vmap rejects its module: two
    of them, with its loss, take a training step and an evaluation as a fused array (once per family of two
    or more); under trainer.`precision` bf16 or fp16, every member HFTA does not take, which vmap would fuse
    in fp32 (vmap applies no autocast), and under fp16 every member (an HFTA array has one gradient scaler:
    one member's overflow would skip its array-mates' steps)."""
    import torch

    logits_of_shape, unfusable = {}, {}
    may_fuse = Counter(m.family for m in members if m.slots == 1)
    for m in members:
        if m.shape not in logits_of_shape:
            logits_of_shape[m.shape] = _on_meta_else_cpu(_forward, m, num_classes, image_sizes[m.input])
        logits = logits_of_shape[m.shape]
        with torch.device(logits.device):
            schedule = build_schedule(m, build_optimizer(m, [torch.nn.Parameter(torch.zeros(1))]), total_steps)
            with _declared(m, "lr_scheduler"):
                _step_as_training_does(schedule)
            loss = build_loss(m)
            with _declared(m, "loss"):
                value = loss(logits, torch.zeros(2, dtype=torch.long))
                if not isinstance(value, torch.Tensor) or value.dim() != 0:
                    raise ValueError("it must return one mean loss (a 0-d tensor) per batch, e.g. reduction='mean'")
        if m.family not in unfusable and may_fuse[m.family] > 1:  # a member with nothing to fuse with takes no step
            try:
                _on_meta_else_cpu(_fused_step, m, num_classes, image_sizes[m.input])
                unfusable[m.family] = None
            except MemberError as err:
                unfusable[m.family] = err.reason
    checked = [replace(m, unfusable=unfusable.get(m.family)) for m in members]
    if precision != "fp32":  # packed or alone, each member trains as it would by itself: fused, it would not
        why = {"vmap": VMAP_NO_AUTOCAST, "hfta": HFTA_ONE_SCALER if precision == "fp16" else None}
        checked = [replace(m, unfusable=why[m.fusion]) if why[m.fusion] and may_fuse[m.family] > 1
                   and not m.unfusable else m for m in checked]
    return checked


def _on_meta_else_cpu(build, *args):
    """`build(*args, device)` on the meta device, else on the CPU (an op that reads values), whose error counts."""
    try:
        return build(*args, "meta")
    except MemberError:
        return build(*args, "cpu")


def _forward(m: ModelSpec, num_classes: int, image_size: int, device: str):
    """The logits for two images of the member's module built on `device`, checked."""
    import torch

    with torch.device(device):
        module = build_module(m, num_classes, image_size)
        with _declared(m, "model"):
            module.train()
            logits = module(torch.zeros(2, 3, image_size, image_size))
            if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (2, num_classes):
                got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
                raise ValueError(f"on a batch of 2 images of {image_size} px it returned {got}, not logits of "
                                 f"shape (2, {num_classes}) for the dataset's {num_classes} classes (the project "
                                 "passes num_classes= where the callable takes it)")
    return logits.detach()


def _fused_step(m: ModelSpec, num_classes: int, image_size: int, device: str) -> None:
    """Two of the member's modules, built on `device`, take a training step's forward and backward and an
    evaluation's forward as one fused array (pipeline/training/stacked.py); what vmap rejects raises a
    MemberError."""
    import torch

    from pipeline.training.stacked import StackedArray

    with torch.device(device):
        nets = [build_module(m, num_classes, image_size) for _ in range(2)]
        loss = build_loss(m)
        with _declared(m, "model"):
            array = StackedArray(nets, loss)
            x = torch.zeros(2, 3, image_size, image_size)
            array.losses(x, torch.zeros(2, dtype=torch.long)).sum().backward()
            with torch.no_grad():
                array.logits(x)


@contextlib.contextmanager
def _declared(m: ModelSpec, key: str):
    """Any error inside becomes one line naming the member, the key and its target."""
    try:
        yield
    except MemberError:
        raise
    except Exception as err:  # whatever the user's code raises: the message is theirs, the place is ours
        target = getattr(m, key).get("_target_", "?")
        while err.__cause__ is not None:  # Hydra's instantiate wraps what the target raised
            err = err.__cause__
        reason = " ".join(str(err).split()) or type(err).__name__
        # (an optimiser's, schedule's or loss's keys may come from the ensemble's, which the member refines)
        where = f"{m.name}.{key}" + ("" if key == "model" else f", or ensemble.{key}")
        raise MemberError(f"ensemble member {m.name}: {key} ({target}): {reason}; fix ensemble.models' {where} "
                          "(docs/configuration.md, ensemble)", m.name, reason) from None


def target_of(config: dict):
    """The object a `_target_` names: the longest importable module of its dotted path, then attributes."""
    path = config["_target_"]
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError as err:
            if err.name and not path.startswith(err.name):  # the module exists, one it imports does not
                raise
            continue
        try:
            return functools.reduce(getattr, parts[split:], found)
        except AttributeError:
            raise ImportError(f"cannot import {path}: module {found.__name__} has no {'.'.join(parts[split:])}")
    raise ImportError(f"cannot import {path}: no module {parts[0]} on the Python path of this host")


def _accepts(target, parameter: str, by_kwargs: bool = False) -> bool:
    """Whether `target` takes `parameter` by name (or, with by_kwargs, any keyword through **kwargs)."""
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature: give it nothing it did not ask for
        return False
    return parameter in parameters or by_kwargs and any(
        p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _refused_keyword(err: BaseException, parameter: str) -> bool:
    """Whether `err`, or what it wraps (Hydra's instantiate wraps what the target raised), is Python's refusal
    of the keyword argument `parameter`."""
    while err is not None:
        if isinstance(err, TypeError) and f"unexpected keyword argument '{parameter}'" in str(err):
            return True
        err = err.__cause__
    return False


def _instantiate(config: dict, *args, **given):
    """Hydra's instantiate, called now (a `_partial_` config too), with plain Python containers."""
    from hydra.utils import instantiate

    return instantiate({**config, "_target_": target_of(config), "_partial_": False, "_convert_": "all"}, *args,
                       **given)


def canonical(value) -> str:
    """A config as one string, the same for equal configs: a key for what they decide."""
    return json.dumps(value, sort_keys=True)


def flatten(tree, prefix: str = "") -> dict:
    """A config as dotted keys, {"a": {"b": 1}} -> {"a.b": 1}: what differs between two, and MLflow's
    parameters."""
    if isinstance(tree, dict) and tree:
        return {key: value for name, sub in tree.items() for key, value in flatten(sub, f"{prefix}{name}.").items()}
    return {prefix[:-1]: tree}


def _zero_or_not(value):
    if isinstance(value, bool) or not isinstance(value, (int, float, list, dict)):
        return value
    if isinstance(value, dict):
        return {key: _zero_or_not(sub) for key, sub in value.items()}
    if isinstance(value, list):
        return [_zero_or_not(sub) for sub in value]
    return "nonzero" if value else "zero"


def _call(config: dict) -> str:
    arguments = ", ".join(f"{key}={value}" for key, value in config.items() if not key.startswith("_"))
    return f"{config['_target_'].rsplit('.', 1)[-1]}({arguments})"
