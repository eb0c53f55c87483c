"""The stage DAG: built from `pipeline.stages` config and validated on the
driver before any Dask work; `run` pushes one batch through it."""
from __future__ import annotations

import importlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.runtime.errors import UserError
from stages.base import BadFileError, Batch, BatchContext, DataKind, Role, Spec, Split, Stage, StageError
from stages.cache import Cache, stored_bytes
from stages.read import ImageFolder, dataset_folder, read_files

CONFIG_ROOT = "pipeline.stages"
RESERVED = ("_target_", "inputs")
BUILT_IN = ("stages.read.ImageFolder", "stages.decode.Decode", "stages.cache.Cache",
            "stages.augment.RandomResizedCropFlip", "stages.broadcast.Broadcast")
# The project's own stages, and profile mode's stand-ins: one that breaks its promise is a bug, not the user's
OWN_MODULES = {target.rpartition(".")[0] for target in BUILT_IN} | {"pipeline.report.profile_run"}


class GraphError(UserError):
    """The stage graph in the config is invalid; the message names the key and the fix."""


@dataclass
class StageTiming:
    wall_s: float = 0.0
    cpu_s: float = 0.0
    items: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


def _nbytes(batch: Batch | None) -> int:
    if batch is None:
        return 0
    if isinstance(batch.data, np.ndarray):
        return batch.data.nbytes
    return sum(len(item) if isinstance(item, bytes) else item.nbytes for item in batch.data)


@dataclass
class BatchOutput:
    """What one batch task returns: a batch per sink, stage timings, bad files; or what stopped it."""

    batches: dict[str, Batch]  # sink -> its batch
    timings: dict[str, StageTiming]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    converted: list[tuple[str, str]] = field(default_factory=list)
    worker: str = ""  # where the batch task ran, and when (time.time()): the run's timeline
    worker_threads: int = 1  # its threads: the worker's busy share is over them
    started: float = 0.0
    ended: float = 0.0
    # What stopped the batch, the user's to fix (a bad file under on_error=fail, a stage's output not as it
    # declares): its message, raised as a UserError where the batch is taken, and nothing else said
    user_error: str | None = None
    cache_hits: int = 0  # with a cache stage: items the node's cache held, of
    cache_lookups: int = 0  # the items looked up there

    @property
    def cpu_s(self) -> float:
        """CPU seconds its stages took in the worker."""
        return sum(timing.cpu_s for timing in self.timings.values())


@dataclass
class StageGraph:
    stages: dict[str, Stage]  # in topological order
    inputs: dict[str, str | None]  # each stage's input stage (None for the source)
    specs: dict[str, Spec]  # each stage's output spec
    # The project's own stages whose output kept its promise once (on the driver's sample, say: the set travels
    # with the graph); their tests hold them to it after that
    proven: set[str] = field(default_factory=set, repr=False)

    @property
    def source(self) -> ImageFolder:
        return next(stage for stage in self.stages.values() if isinstance(stage, ImageFolder))

    @property
    def cache_name(self) -> str | None:
        return next((name for name, stage in self.stages.items() if isinstance(stage, Cache)), None)

    @property
    def cache(self) -> Cache | None:
        return self.stages[self.cache_name] if self.cache_name else None

    def sample(self, count: int) -> tuple[Batch, BatchContext]:
        """`count` files spread over the dataset through the stages that make its images: those before the
        cache, with one (what it keeps), else those feeding the first sink. Returns the batch, which leaves
        out the files that could not be used, and its context, which names them (`skipped`)."""
        files = self.source.files[Split.TRAIN] + self.source.files[Split.VAL]
        picks = [files[i] for i in np.linspace(0, len(files) - 1, min(count, len(files))).astype(int)]
        ctx = BatchContext(seed=0, split=Split.TRAIN, epoch=0, index=0, wanted=picks)  # the source reads these
        until = self.inputs[self.cache_name] if self.cache_name else next(iter(self.sinks))
        batch = None
        for stage_name in self.feeding({until}).stages:  # in order
            batch = self.through(stage_name, batch, ctx, f"the {len(picks)} files sampled at the run's start",
                                 len(picks))
        return batch, ctx

    def cached_bytes_per_item(self, sample: Batch) -> float | None:
        """Shared memory the cache takes per file (pages counted as the cache counts them), from `sample`
        (self.sample's batch). None without a cache, or when no sampled file could be used."""
        if self.cache_name is None or not sample.data:
            return None
        return float(np.mean([stored_bytes(image) for image in sample.data]))

    @property
    def sinks(self) -> dict[str, Spec]:
        return {name: self.specs[name] for name, stage in self.stages.items() if stage.role is Role.SINK}

    @property
    def image_sizes(self) -> dict[str, int]:
        """Each sink's image side, in px."""
        return {name: spec.item_shape[0] for name, spec in self.sinks.items()}

    def feeding(self, sinks: set[str]) -> StageGraph:
        """The part of the graph these sinks need: a flotilla whose models read
        only some sinks does not compute the others."""
        needed: set[str] = set()
        for name in sinks:
            while name and name not in needed:
                needed.add(name)
                name = self.inputs[name]
        return StageGraph({n: s for n, s in self.stages.items() if n in needed},
                          {n: i for n, i in self.inputs.items() if n in needed},
                          {n: spec for n, spec in self.specs.items() if n in needed})

    def run(self, ctx: BatchContext) -> BatchOutput:
        """One batch through every stage, fused in this thread, each stage timed."""
        ctx.root = self.source.prefix
        outputs: dict[str, Batch] = {}
        timings: dict[str, StageTiming] = {}
        cache, lookup_s = self.cache, (0.0, 0.0)
        making = f"{ctx.split.value} batch {ctx.index} of epoch {ctx.epoch}"
        most = -(-self.source.batch_size // ctx.parts)  # the task's share of a full batch
        if cache:  # before the source: what it holds is not read (the time is the cache stage's)
            wall, cpu = time.perf_counter(), time.thread_time()
            cache.lookup(self.source.items(ctx), ctx)
            lookup_s = (time.perf_counter() - wall, time.thread_time() - cpu)
        for name, stage in self.stages.items():
            given = outputs[self.inputs[name]] if self.inputs[name] else None
            wall, cpu = time.perf_counter(), time.thread_time()
            outputs[name] = self.through(name, given, ctx, making, most)
            if stage is cache:
                wall, cpu = wall - lookup_s[0], cpu - lookup_s[1]
            timings[name] = StageTiming(time.perf_counter() - wall, time.thread_time() - cpu,
                                        len(outputs[name].labels), _nbytes(given), _nbytes(outputs[name]))
        batches = {name: outputs[name] for name in self.sinks}
        lookups = len(ctx.wanted) if cache and cache.budget_bytes else 0  # a cache turned off holds nothing
        return BatchOutput(batches, timings, ctx.skipped, ctx.converted, cache_hits=len(ctx.held),
                           cache_lookups=lookups)

    def through(self, name: str, given: Batch | None, ctx: BatchContext, making: str, most: int) -> Batch:
        """Stage `name`'s output for `given`, held to its output spec (at most `most` items, labels of the
        dataset's classes), which the stages after it and the trainers take as promised: a user's stage's
        every batch, item by item; the project's own stages' first batch, as a whole (their tests hold
        them to it). A stage's error names the stage and what it was `making`: a user's stage that breaks
        its promise is the user's to mend, one of the project's a bug."""
        stage = self.stages[name]
        made = _made_by(name, stage, given, ctx, making)
        if name in self.proven:
            return made
        spec, own = self.specs[name], type(stage).__module__ in OWN_MODULES
        broken = spec.broken_by(made, most, len(self.source.class_names)) or (not own and spec.items_broken_by(made))
        if broken:
            broken = f"{_where(name, stage, making)}: {broken}"
            if own:
                raise RuntimeError(f"{broken} (a bug in the project's own stage)")
            raise GraphError(f"{broken}; make its __call__ return what its output_spec declares")
        if own:
            self.proven.add(name)
        return made


def build_graph(stages_cfg: dict[str, dict[str, Any]], consumed: set[str]) -> StageGraph:
    """Instantiate and check the DAG. `consumed`: the sinks some model reads."""
    if not stages_cfg:
        raise GraphError(f"{CONFIG_ROOT} is empty; declare at least a source, a decode, an augment and a sink stage")
    stages = {name: _instantiate(name, entry) for name, entry in stages_cfg.items()}
    inputs = {name: _single_input(name, stages_cfg[name], stages) for name in stages}
    order = _topological_order(inputs)
    specs: dict[str, Spec] = {}
    for name in order:
        stage, upstream = stages[name], inputs[name]
        if upstream is not None and stage.accepts is not specs[upstream].kind:
            raise GraphError(
                f"{CONFIG_ROOT}.{name}.inputs: '{upstream}' produces {specs[upstream]} but "
                f"{type(stage).__name__} accepts {stage.accepts.value}; "
                f"feed it from a stage that produces {stage.accepts.value}")
        specs[name] = _promised(name, stage, stage.output_spec(specs[upstream] if upstream else None))
    _check_ends(stages, inputs, consumed)
    _check_cache(stages, inputs)
    _tell_consumer_needs({name: stages[name] for name in reversed(order)}, inputs)
    return StageGraph({name: stages[name] for name in order}, inputs, specs)


@dataclass
class Prepared:
    """Files made into each sink's images (FilePreprocessing): row i of every sink's array is `paths[i]`."""

    images: dict[str, np.ndarray]  # each sink's uint8 NHWC images
    paths: list[str]  # the files given, in their order, but those that could not be used
    skipped: dict[str, str]  # each of those: why


@dataclass
class FilePreprocessing:
    """A run's stages outside the run (pipeline.predict): any image files made into each sink's validation
    batch as the run made its validation images, the files read in the source's place and passed through a
    cache (it holds nothing here)."""

    stages: dict[str, Stage]  # the source's consumers and theirs, in topological order
    inputs: dict[str, str]  # each one's input stage (the source's name for its consumers)
    source: str
    sinks: list[str]
    seed: int  # the run's, and its dataset's folder: what a stage's ctx.item_rng is keyed by
    root: str

    def __call__(self, paths: list[str]) -> Prepared:
        """Each sink's images of `paths`; a file that cannot be used is left out of every sink's, saying why."""
        items = [(str(path), 0) for path in paths]  # labels unknown: class 0's
        ctx = BatchContext(seed=self.seed, split=Split.VAL, epoch=0, index=0, root=self.root,
                           wanted=items if any(isinstance(stage, Cache) for stage in self.stages.values()) else None)
        outputs = {self.source: read_files(items, ctx)}
        making = f"a batch of {len(items)} files to predict"
        for name, stage in self.stages.items():
            given = outputs[self.inputs[name]]
            outputs[name] = given if isinstance(stage, Cache) else _made_by(name, stage, given, ctx, making)
        bad = dict(ctx.skipped)
        kept = [path for path, _ in items if path not in bad]
        images = {}
        for sink in self.sinks:  # a file one branch rejected is left out of the others' too
            rows = [i for i, path in enumerate(outputs[sink].paths) if path not in bad]
            if [outputs[sink].paths[i] for i in rows] != kept:  # rows would be given to the wrong files
                raise GraphError(f"{CONFIG_ROOT}.{sink}: its batch of {len(items)} files to predict holds other files"
                                 " or another order than it was given: a stage on its branch leaves a file out "
                                 "without ctx.reject, or reorders them; make it keep its batch's order")
            images[sink] = outputs[sink].data if len(rows) == len(outputs[sink].paths) else outputs[sink].data[rows]
        return Prepared(images, kept, bad)


def _made_by(name: str, stage: Stage, given: Batch | None, ctx: BatchContext, making: str) -> Batch:
    """Stage `name`'s output for `given`; its error names the stage and what it was `making`."""
    ctx.stage = name
    try:
        return stage(given, ctx)
    except BadFileError:
        raise  # it names the file and the fix
    except UserError as err:
        raise GraphError(f"{_where(name, stage, making)}: {err}") from None
    except Exception as err:
        err.add_note(f"in {_where(name, stage, making)}")
        raise


def _where(name: str, stage: Stage, making: str) -> str:
    """Stage `name` and what it was making, for its errors (made only for them: a stage runs per batch)."""
    return f"{CONFIG_ROOT}.{name} ({_declared(stage)}), making {making}"


def file_preprocessing(stages_cfg: dict[str, dict[str, Any]], seed: int, root: str) -> FilePreprocessing:
    """`pipeline.stages` of a run that built them (its results.json `config`), but the source, which is
    not built: its dataset need not be there. `seed` and `root`: the run's seed and dataset.root."""
    try:
        targets = {name: _stage_class(entry["_target_"], f"{CONFIG_ROOT}.{name}")
                   for name, entry in stages_cfg.items()}
    except GraphError as err:
        raise GraphError(f"{err} (the run's stages, as its results.json's config declares them: a module of "
                         "yours must import here as it did where the run trained)") from None
    source = next(name for name, cls in targets.items() if cls.role is Role.SOURCE)
    inputs = {name: entry["inputs"][0] for name, entry in stages_cfg.items() if name != source}
    order = [name for name in _topological_order({source: None, **inputs}) if name != source]
    stages = {name: _instantiate(name, stages_cfg[name]) for name in order}
    _tell_consumer_needs({name: stages[name] for name in reversed(order)}, inputs)
    sinks = [name for name in order if targets[name].role is Role.SINK]
    return FilePreprocessing(stages, inputs, source, sinks, seed, dataset_folder(root))


def _instantiate(name: str, entry: dict[str, Any]) -> Stage:
    key = f"{CONFIG_ROOT}.{name}"
    if not isinstance(entry, dict) or "_target_" not in entry:
        raise GraphError(f"{key} has no _target_; set it to a stage class, e.g. stages.decode.Decode")
    cls = _stage_class(entry["_target_"], key)
    given = {k: v for k, v in entry.items() if k not in RESERVED}
    allowed = cls.config_fields()
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise GraphError(f"{key}.{unknown[0]}: {cls.__name__} has no field '{unknown[0]}'; "
                         f"its fields are: {', '.join(allowed) or '(none)'}")
    try:
        inspect.signature(cls).bind(**given)
    except TypeError as err:  # a required field is missing (bound first: a TypeError the stage raises is a bug)
        raise GraphError(f"{key}: {err}; {cls.__name__}'s fields are: {', '.join(allowed)}") from None
    try:
        return cls(**given)
    except StageError as err:
        raise GraphError(f"{key}: {err}") from None


def _promised(name: str, stage: Stage, spec: object) -> Spec:
    """`spec`, what the stage's output_spec returned, if it says what a batch holds: a Spec of a DataKind, a
    tensor's with its item shape (height, width, 3) in positive ints; a sink's a square tensor's, whose side
    the models that read it are built for."""
    tensor = isinstance(spec, Spec) and spec.kind is DataKind.TENSOR
    shape = spec.item_shape if tensor else None
    shaped = isinstance(spec, Spec) and isinstance(spec.kind, DataKind) and (not tensor or (
        isinstance(shape, tuple) and len(shape) == 3 and shape[2] == 3
        and all(type(n) is int and n > 0 for n in shape)))
    if not shaped:
        raise GraphError(f"{CONFIG_ROOT}.{name}: {_declared(stage)}.output_spec returned {spec!r}, not a "
                         "stages.base.Spec of what it makes (a tensor's with its item shape: (height, width, 3), "
                         "positive ints)")
    if stage.role is Role.SINK and not (tensor and shape[0] == shape[1]):
        raise GraphError(f"{CONFIG_ROOT}.{name}: {_declared(stage)} is a sink making {spec}; a sink hands the "
                         "models square images of one size (a tensor of (side, side, 3)): feed it from a crop")
    return spec


def _declared(stage: Stage) -> str:
    """The stage's class as `_target_` names it."""
    return f"{type(stage).__module__}.{type(stage).__qualname__}"


def _stage_class(target: str, key: str) -> type[Stage]:
    module_name, _, class_name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:  # why: a user's module may import what is not installed
        raise GraphError(f"{key}._target_: cannot import '{target}' ({err}); built-in stages are "
                         f"{', '.join(BUILT_IN)}") from None
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise GraphError(f"{key}._target_: '{target}' is not a Stage (subclass stages.base.Stage)")
    return cls


def _single_input(name: str, entry: dict[str, Any], stages: dict[str, Stage]) -> str | None:
    key = f"{CONFIG_ROOT}.{name}.inputs"
    inputs = list(entry.get("inputs") or [])
    stage = stages[name]
    if stage.role is Role.SOURCE:
        if inputs:
            raise GraphError(f"{key}: {type(stage).__name__} is a source and takes no inputs; remove {inputs}")
        return None
    if len(inputs) != 1:
        raise GraphError(f"{key}: {type(stage).__name__} takes exactly one input, got {inputs or 'none'}; "
                         f"name the stage it reads from, e.g. inputs: [{next(iter(stages))}]")
    if inputs[0] not in stages:
        raise GraphError(f"{key}: no stage named '{inputs[0]}'; stages are: {', '.join(stages)}")
    return inputs[0]


def _topological_order(inputs: dict[str, str | None]) -> list[str]:
    order: list[str] = []
    placed: set[str] = set()
    pending = dict(inputs)
    while pending:
        ready = [name for name, upstream in pending.items() if upstream is None or upstream in placed]
        if not ready:
            cycle = " -> ".join(sorted(pending))
            raise GraphError(f"{CONFIG_ROOT}: the inputs of {cycle} form a cycle; "
                             "every branch must start at the source stage")
        for name in ready:
            order.append(name)
            placed.add(name)
            del pending[name]
    return order


def _check_ends(stages: dict[str, Stage], inputs: dict[str, str | None], consumed: set[str]) -> None:
    sources = [name for name, stage in stages.items() if stage.role is Role.SOURCE]
    if len(sources) != 1 or not isinstance(stages[sources[0]], ImageFolder):
        raise GraphError(f"{CONFIG_ROOT}: need exactly one source stage (stages.read.ImageFolder), found "
                         f"{sources or 'none'}")
    fed = {upstream for upstream in inputs.values() if upstream}
    for name, stage in stages.items():
        if stage.role is Role.SINK:
            if name not in consumed:
                raise GraphError(f"{CONFIG_ROOT}.{name} is a sink no model reads; set some model's "
                                 f"input to '{name}' or remove the stage")
            if name in fed:
                raise GraphError(f"{CONFIG_ROOT}.{name} is a sink and cannot feed other stages")
        elif name not in fed:
            raise GraphError(f"{CONFIG_ROOT}.{name}: its output goes nowhere; end the branch with a sink "
                             "(_target_: stages.broadcast.Broadcast, inputs: [" + name + "])")
    sinks = {name for name, stage in stages.items() if stage.role is Role.SINK}
    unknown = sorted(consumed - sinks)
    if unknown:
        raise GraphError(f"a model's input is '{unknown[0]}', which is not a sink in {CONFIG_ROOT}; "
                         f"sinks are: {', '.join(sorted(sinks)) or '(none)'}")


def _check_cache(stages: dict[str, Stage], inputs: dict[str, str | None]) -> None:
    """A cache holds what every epoch makes alike, and stands on the one path all branches take: then
    the files it holds need not be read or decoded at all."""
    caches = [name for name, stage in stages.items() if isinstance(stage, Cache)]
    if len(caches) > 1:
        raise GraphError(f"{CONFIG_ROOT}: one cache stage at most, found {', '.join(caches)}; keep the one "
                         "right after decode")
    for name in caches:
        below, upstream = name, inputs[name]
        while upstream:
            stage = stages[upstream]
            if not stage.same_every_epoch:
                raise GraphError(f"{CONFIG_ROOT}.{name}.inputs: {type(stage).__name__} ('{upstream}') may make "
                                 "something else of a file each epoch (it does not set same_every_epoch), so a "
                                 "cache after it would repeat one epoch's output; put the cache right after "
                                 "decode, before the random augmentations")
            others = [c for c, u in inputs.items() if u == upstream and c != below]
            if others:
                raise GraphError(f"{CONFIG_ROOT}.{others[0]}.inputs: '{upstream}' feeds the cache '{name}', and "
                                 f"'{others[0]}' beside it would need every file read and decoded anyway; take "
                                 f"its input from '{name}'")
            below, upstream = upstream, inputs[upstream]


def _tell_consumer_needs(stages: dict[str, Stage], inputs: dict[str, str | None]) -> None:
    """Let each stage know the detail its consumers need (decode may shrink to it); `stages` come
    consumers first, so a stage that passes its consumers' need on (the cache) has it when asked."""
    for name, stage in stages.items():
        needs = [stages[c].min_input_side() for c, upstream in inputs.items() if upstream == name]
        stage.set_consumer_need(None if not needs or None in needs else max(needs))
