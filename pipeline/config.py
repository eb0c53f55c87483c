"""Config schema: the structured config every run is checked against, and the
few checks a type cannot express.

Stored in Hydra's ConfigStore as `schema` and named first in pipeline/conf/config.yaml's
defaults, so a misspelt key, a wrong type or a value outside an Enum fails at
composition with the key's full name and the allowed values. `check` runs
once before a run starts and covers the rest (ranges, `auto` or a count).
Stage entries under `pipeline.stages` are checked by the graph builder against
each stage's own dataclass (pipeline/data/graph.py): such overrides bypass
this schema.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import enum
import errno
import fcntl
import importlib.util
import itertools
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Union

from hydra.core.config_store import ConfigStore
from hydra.utils import to_absolute_path
from omegaconf import MISSING, DictConfig, OmegaConf

from pipeline.data.dataset import Synthetic
from pipeline.measure.objective import BEST_MEMBER, ENSEMBLE, Metric
from pipeline.runtime.errors import UserError
from pipeline.scheduler.topology import Topology
from pipeline.orchestration.devices import DeviceKind
from pipeline.scheduler.slot_groups import Grouping
from pipeline.scheduler.policies import PolicyName
from pipeline.training.group import Precision, least_batch
from pipeline.training.members import ModelSpec, member_seed
from stages.base import OnError
from stages.decode import DecodeBackend

AUTO = "auto"


STATE_DIR = "state"  # in a run's folder: what resume= continues from
# What a run leaves in its folder: a fresh run refuses a folder holding any (check_output_dir)
RUN_OUTPUTS = ("results.json", STATE_DIR, "checkpoints")
RUN_LOCK = ".run.lock"  # in a run's folder: locked (flock) by the process writing there, whose pid it holds
LOCK_TRIES = 10  # times a run locks RUN_LOCK that its holder removed as it ended, before it gives up
_claimed: dict[Path, IO | None] = {}  # the folders this process writes to, with their locks held
os.register_at_fork(after_in_child=_claimed.clear)  # a forked child holds none of them


class ExitCode(enum.IntEnum):
    """How `python -m pipeline` ends (the table in docs/configuration.md)."""

    ok = 0
    crashed = 1  # an unexpected error: its traceback is shown
    user_error = 2  # config, data, slots, memory: one message says what and the fix
    models_given_up = 3  # trained, but a model failed more than scheduler.max_failures times
    hung = 4  # something the run waited for did not come within its timeout
    nodes_lost = 5  # hosts were lost and no slot left can take the models still to train: resume=<run folder>
    sigint = 130  # stopped by Ctrl-C: resume=<run folder> continues it
    sighup = 129  # its terminal hung up (an ssh session dropped): stopped in order, the same
    sigpipe = 141  # its output's reader went away (| head): stopped in order, the same
    sigterm = 143  # stopped by SIGTERM: the same


class JobFailed(Exception):
    """A multirun's job that did not finish (pipeline/__main__.py): why, and the exit code it would
    have ended with on its own. Raised to Hydra, which marks the job failed; it crosses processes under
    the joblib and submitit launchers, so it pickles."""

    def __init__(self, code: int, why: str):
        super().__init__(code, why)
        self.code, self.why = ExitCode(code), why

    def __str__(self) -> str:
        return f"{self.why} (exit code {self.code.value} on its own)"


class Mode(enum.StrEnum):
    train = "train"  # train the ensemble
    profile = "profile"  # a short profiling pass that writes the report; no training


class ConfigError(UserError):
    """A config value the schema's types let through but a run cannot use."""


def exit_on_user_error(err: UserError) -> None:
    """One clean message on stderr and exit code 2, after its traceback where the user asked Hydra for full
    tracebacks (HYDRA_FULL_ERROR=1). It exits rather than raise: Hydra turns a callback's exceptions into
    warnings and carries on."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        traceback.print_exception(err)
    print(f"error: {err}", file=sys.stderr)
    sys.exit(ExitCode.user_error)


@dataclass
class DatasetConf:
    name: str = "caltech256"  # label used in reports
    root: str = "data/caltech256"  # ImageFolder tree (class folders); relative paths start where you ran the command
    synthetic: Synthetic = Synthetic.auto  # auto: generate a labelled stand-in when root is missing or empty;
    # never: error instead
    synthetic_classes: int = 10  # classes of the generated stand-in
    synthetic_images_per_class: int = 110  # images per class of the generated stand-in
    synthetic_difficulty: float = 0.3  # 0 (every model learns it in two epochs) to 1 (the classes blend most)
    val_per_class: Optional[float] = None  # validation images per class: a fraction if < 1, else a count;
    # null: the dataset's own split (the stand-in declares 0.23: 30 of 129 a class), else 0.1


@dataclass
class PipelineConf:
    batch_size: int = 64  # images per batch task and per training step (split across a model's slots)
    image_size: int = 64  # output side of the main augment branch
    alt_image_size: int = 48  # output side of the second augment branch
    decode_backend: DecodeBackend = DecodeBackend.simplejpeg  # simplejpeg | pillow | dali
    cache_gb: float = 2.0  # per node: shared memory that keeps decoded images across epochs (0: off)
    stages: Dict[str, Any] = field(default_factory=dict)  # the stage DAG: name -> {_target_, inputs, fields}


@dataclass
class TlsConf:
    ca_file: Optional[str] = None  # PEM file of the CA that signed every certificate of the cluster
    cert: Optional[str] = None  # PEM file of this host's certificate, presented to the scheduler
    key: Optional[str] = None  # PEM file of its private key (keep it mode 0600)


@dataclass
class ClusterConf:
    address: Optional[str] = None  # tcp://host:8786 uses that Dask scheduler; null starts a LocalCluster here
    workers: Union[int, str] = AUTO  # LocalCluster worker processes; auto = CPU cores of this machine
    threads_per_worker: int = 1  # batch tasks one worker runs at once (stages are single-threaded)
    in_flight: Union[int, str] = AUTO  # prefetch window: batch tasks submitted ahead of each producer;
    # auto = 2 x its node's worker threads
    nodes: int = 1  # nodes: LocalCluster workers and trainer slots split into this many simulated nodes
    # (loopback); with address: one agent per host (python -m pipeline.node <address> --node <i>),
    # or workers carrying the resource node-<i> (dask worker --resources node-0=1) with hubs and trainers here
    dashboard: bool = False  # the LocalCluster serves Dask's dashboard on 127.0.0.1 (its link is printed)
    tls: TlsConf = field(default_factory=TlsConf)  # with address=tls://...: Dask's TLS security, all three files
    agent_key_file: Optional[str] = None  # node agents' shared secret (a mode 0600 file); null: the environment
    # variable PIPELINE_AGENT_KEY


@dataclass
class DeliveryConf:
    ring_depth: int = 4  # batches each shared-memory ring (one per sink) holds; a slow trainer holds back the producer
    broadcast_streams: int = 2  # multi_broadcast: streams of models of like speed, each fed by its own producer


@dataclass
class HalvingConf:
    eta: int = 0  # successive halving: at each rung all but the best 1/eta of its members stop (0: off; 2, 3, 4)
    min_epochs: int = 1  # the first rung; the next ones at min_epochs x eta, x eta^2, ...


@dataclass
class SchedulerConf:
    # shared (all models at once) | fleet_e | fleet_g | fleet_l | baseline | homogeneous
    policy: PolicyName = PolicyName.shared
    min_active_fraction: float = 0.8  # fleet_g/fleet_l: a flotilla stops when fewer of its slots are active
    phase_threshold: float = 0.0  # fleet_e: a model whose training loss fell less than this fraction in an epoch
    # is on its plateau and gives its slots above one to models still improving (0: off)
    join_running: bool = False  # fleet_l/fleet_e: a waiting model of like rate joins a running flotilla's stream
    # at its next epoch boundary, instead of forming a flotilla of its own
    target_accuracy: Optional[float] = None  # a model converges on reaching this validation accuracy
    patience: int = 0  # ...or after this many epochs without improving its best by min_delta (0: off)
    min_delta: float = 0.005  # the smallest gain in validation accuracy that counts
    checkpoint_every: int = 1  # epochs between a model's checkpoints (its final one, and a stop's, come anyway)
    max_failures: int = 2  # a model whose trainers fail more often is given up (the run then exits with code 3)
    halving: HalvingConf = field(default_factory=HalvingConf)  # members ranked by objective.metric at each rung


@dataclass
class RatesConf:
    max_slots: int = 2  # each model's training rate is measured on 1..this many slots (one node at most)
    steps: int = 5  # timed training steps per measurement
    warmup: int = 2  # untimed steps first
    cache: str = "outputs/rate_cache.json"  # measured rates, keyed by model shape and hardware


@dataclass
class TrainerConf:
    epochs: int = 4  # the most epochs a model trains (it may converge earlier: scheduler.*)
    device: DeviceKind = DeviceKind.auto  # auto (CUDA if present) | cuda | cpu
    slots: Union[int, str] = AUTO  # device slots: auto = every GPU, or on CPU one slot per model slot requested
    slots_per_device: int = 1  # trainer processes sharing each device, each a slot of its own (sub-slots): a
    # GPU, or on CPU a slot of trainer.threads threads that they split; above 1, a model trains on one slot
    # (no data-parallel) and a slot has its share of the device's memory. grouping=auto may choose more
    grouping: Grouping = Grouping.auto  # models outnumbering the slots share them: auto (fuse where measured
    # faster, else pack) | pack (step in turn) | fuse (one family's members as one fused array) |
    # separate (never share: fails when models outnumber slots)
    precision: Precision = Precision.fp32  # fp32 | bf16 | fp16 (autocast; fp16 with a gradient scaler)
    cuda_graphs: bool = True  # on a GPU, each step captured once as a CUDA graph and replayed (not fp16, DDP)
    compile: bool = False  # each member's forward compiled by torch.compile (inductor) on its first steps:
    # their seconds are measured with the rates and reported by the trainers
    threads: int = 1  # torch threads per CPU trainer process
    slot_memory_gb: Optional[float] = None  # memory one slot may use; null: the GPU's, or RAM / slots on CPU
    record_checksums: bool = False  # trainers report a CRC of every message received (delivery tests)
    consume_only: bool = False  # trainers take each batch and train nothing: measures delivery alone


@dataclass
class ProfileConf:
    batches: int = 300  # mode=profile: training batches through the pipeline (epochs repeat if it has fewer)
    steps: int = 10  # timed training steps per model shape in each differential pass
    warmup: int = 2  # untimed steps first (worker and allocator start-up)


@dataclass
class TimeoutsConf:
    report_s: float = 1800  # a trainer or rate measurement that owes a report and stays silent this long is hung
    drain_s: float = 60  # a closing producer lets its running batch tasks finish this long before it is stopped
    exit_s: float = 30  # a flotilla's processes that have finished get this long to exit before they are killed
    stop_s: float = 10  # a stop (Ctrl-C, SIGTERM, ...): the last epochs' checkpoints and the close take at most this
    warn_s: float = 60  # a wait without progress this long says what it waits for (once)
    stall_s: float = 600  # ...and fails this long without progress: no batch task result, no batch published
    collective_s: float = 900  # an exchange between hubs or a DDP collective not done in this long fails
    host_s: float = 30  # a node agent's host (or the driver's, seen from an agent) silent this long is lost


@dataclass
class MemberConf:
    name: str = MISSING  # unique name, used for checkpoints and reports
    input: str = MISSING  # the sink (a broadcast stage) it trains on
    model: Any = MISSING  # {_target_: <callable returning an nn.Module>, its arguments}; given num_classes, and
    # image_size where it takes one (pipeline.training.models.resnet / densenet are the built-in families)
    optimizer: Dict[str, Any] = field(default_factory=dict)  # its keys over ensemble.optimizer (e.g. {lr: 0.1});
    # a dict naming another _target_ replaces it
    lr_scheduler: Dict[str, Any] = field(default_factory=dict)  # the same, over ensemble.lr_scheduler
    loss: Dict[str, Any] = field(default_factory=dict)  # the same, over ensemble.loss
    seed: Optional[int] = None  # of its initial weights; null: derived from the run's seed and its name
    slots: int = 1  # device slots it trains on, data-parallel (DDP) when > 1


@dataclass
class EnsembleConf:
    models: List[MemberConf] = field(default_factory=list)  # the ensemble's members
    optimizer: Any = None  # every member's, unless its own says otherwise: pipeline/conf/optimizer/ (sgd by default)
    lr_scheduler: Any = None  # stepped each training step, or each epoch on a metric: pipeline/conf/lr_scheduler/
    loss: Any = None  # pipeline/conf/loss/ (cross_entropy by default)
    grid: Dict[str, Any] = field(default_factory=dict)  # member keys -> lists of values, e.g.
    # {optimizer: {lr: [0.1, 0.01]}}: every member that has the keys trains once per combination


@dataclass
class TrackingConf:
    tensorboard: bool = True  # each member's epochs as TensorBoard event files too (tracking/<member>/)
    mlflow: Optional[str] = None  # an MLflow tracking URI (file:./mlruns, http://host:5000): a run per member
    # under one per run; null: off (MLflow is optional: pip install mlflow-skinny)
    mlflow_experiment: str = "ensemble"  # the MLflow experiment the runs go to


@dataclass
class ObjectiveConf:
    of: str = ENSEMBLE  # what the run returns to a Hydra sweeper: ensemble | best_member | a member's name
    metric: Metric = Metric.val_accuracy  # val_accuracy (a sweeper maximizes it) | val_loss (minimizes)


@dataclass
class Config:
    mode: Mode = Mode.train  # train | profile (a short profiling pass that writes the report, no training)
    topology: Topology = Topology.auto  # how batches reach a flotilla's trainers: auto | single_broadcast |
    # all_shared | multi_broadcast | duplicated (docs/topologies.md)
    seed: int = 0  # fixes shuffling and augmentation, whatever the number of workers
    on_error: OnError = OnError.skip  # a bad data file: skip (counted and listed) | fail (stop naming it)
    dataset: DatasetConf = field(default_factory=DatasetConf)
    pipeline: PipelineConf = field(default_factory=PipelineConf)
    cluster: ClusterConf = field(default_factory=ClusterConf)
    delivery: DeliveryConf = field(default_factory=DeliveryConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    scheduler: SchedulerConf = field(default_factory=SchedulerConf)
    rates: RatesConf = field(default_factory=RatesConf)
    profile: ProfileConf = field(default_factory=ProfileConf)
    timeouts: TimeoutsConf = field(default_factory=TimeoutsConf)
    ensemble: EnsembleConf = field(default_factory=EnsembleConf)  # members chosen with +ensemble=<name>
    objective: ObjectiveConf = field(default_factory=ObjectiveConf)  # the value a training run returns
    tracking: TrackingConf = field(default_factory=TrackingConf)  # each member's metrics per epoch: tracking/
    resume: Optional[str] = None  # a stopped or crashed run's folder: continue it there (same config)


def register() -> None:
    ConfigStore.instance().store(name="schema", node=Config)


def check(cfg: DictConfig) -> None:
    """What the schema's types cannot say; each error names the key, the value and the fix."""
    for key in ("cluster.workers", "cluster.in_flight", "trainer.slots"):
        value = OmegaConf.select(cfg, key)
        if value != AUTO and not (isinstance(value, int) and value >= 1):
            raise ConfigError(f"{key}={value!r}: give a positive integer or 'auto'")
    one_rank = least_batch(1)
    least = {"pipeline.batch_size": (one_rank, f"a training step needs at least {one_rank} images (batch norm)"),
             "cluster.threads_per_worker": (1, "a worker runs at least one batch task"),
             "cluster.nodes": (1, "a run has at least one node"),
             "delivery.ring_depth": (2, "one batch is being read while the next is written"),
             "delivery.broadcast_streams": (1, "multi_broadcast feeds at least one stream"),
             "trainer.epochs": (1, "a model trains at least one epoch"),
             "scheduler.checkpoint_every": (1, "a model is checkpointed at least every epoch count given"),
             "scheduler.max_failures": (0, "it cannot be negative"),
             "trainer.threads": (1, "a trainer has at least one thread"),
             "trainer.slots_per_device": (1, "a device holds at least one slot"),
             "rates.max_slots": (1, "rates are measured on at least one slot"),
             "rates.steps": (1, "a measurement times at least one step"), "rates.warmup": (0, "it cannot be negative"),
             "profile.batches": (1, "the pass moves at least one batch"),
             "profile.steps": (1, "each differential pass times at least one step"),
             "profile.warmup": (0, "it cannot be negative")}
    for key, (smallest, why) in least.items():
        value = OmegaConf.select(cfg, key)
        if value < smallest:
            raise ConfigError(f"{key}={value}: {why}; set {key}={smallest} or more")
    for key in ("timeouts.report_s", "timeouts.drain_s", "timeouts.exit_s", "timeouts.stop_s", "timeouts.warn_s",
                "timeouts.stall_s", "timeouts.collective_s", "timeouts.host_s"):
        if OmegaConf.select(cfg, key) <= 0:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)}: a wait must be positive seconds")
    if cfg.timeouts.warn_s >= cfg.timeouts.stall_s:
        raise ConfigError(f"timeouts.warn_s={cfg.timeouts.warn_s} is not below timeouts.stall_s="
                          f"{cfg.timeouts.stall_s}: a wait says what it waits for before it fails; lower warn_s")
    _check_tls(cfg.cluster)
    if not 0 <= cfg.dataset.synthetic_difficulty <= 1:
        raise ConfigError(f"dataset.synthetic_difficulty={cfg.dataset.synthetic_difficulty}: give a value in [0, 1] "
                          "(0: easy, 1: the classes blend most)")
    if cfg.dataset.val_per_class is not None and cfg.dataset.val_per_class < 0:
        raise ConfigError(f"dataset.val_per_class={cfg.dataset.val_per_class}: give a fraction < 1 (e.g. 0.1) or "
                          "a count of validation images per class, or null for the dataset's own split")
    if not 0 <= cfg.scheduler.min_active_fraction <= 1:
        raise ConfigError(f"scheduler.min_active_fraction={cfg.scheduler.min_active_fraction}: give a fraction in "
                          "[0, 1]; FLEET uses 0.8")
    s = cfg.scheduler
    if s.target_accuracy is not None and not 0 < s.target_accuracy <= 1:
        raise ConfigError(f"scheduler.target_accuracy={s.target_accuracy}: give the share of validation images "
                          "right, in (0, 1] (e.g. 0.9 for 90%), or null for no target")
    if s.patience < 0:
        raise ConfigError(f"scheduler.patience={s.patience}: give the epochs without a gain of min_delta after "
                          "which a model stops, or 0 for no such rule")
    if not 0 <= s.min_delta < 1:
        raise ConfigError(f"scheduler.min_delta={s.min_delta}: give the smallest gain in validation accuracy that "
                          "counts, in [0, 1) (e.g. 0.005 for half a point)")
    if cfg.scheduler.halving.eta != 0 and cfg.scheduler.halving.eta < 2:
        raise ConfigError(f"scheduler.halving.eta={cfg.scheduler.halving.eta}: give 2 or more (the best 1/eta of "
                          "a rung's members go on), or 0 for no halving")
    if cfg.scheduler.halving.min_epochs < 1:
        raise ConfigError(f"scheduler.halving.min_epochs={cfg.scheduler.halving.min_epochs}: the first rung comes "
                          "after at least one epoch; set scheduler.halving.min_epochs=1 or more")
    if cfg.tracking.mlflow and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(f"tracking.mlflow={cfg.tracking.mlflow}: MLflow is not installed here; pip install "
                          "mlflow-skinny, or set tracking.mlflow=null")
    if not 0 <= cfg.scheduler.phase_threshold < 1:
        raise ConfigError(f"scheduler.phase_threshold={cfg.scheduler.phase_threshold}: give the fraction of the "
                          "training loss an epoch must remove, in [0, 1) (e.g. 0.02), or 0 to leave phases unused")


def _check_tls(cluster: DictConfig) -> None:
    """TLS: all three files, each readable, for a tls:// scheduler; a local cluster listens on loopback only."""
    keys = {f"cluster.tls.{name}": value for name, value in cluster.tls.items()}
    given = [key for key, value in keys.items() if value]
    tls_address = (cluster.address or "").startswith("tls://")
    if not given and not tls_address:
        return
    if not cluster.address:
        raise ConfigError(f"{given[0]} is set but a local cluster listens on loopback only and needs no TLS; "
                          "set cluster.address=tls://<scheduler>:<port> or drop cluster.tls")
    if not tls_address:
        raise ConfigError(f"cluster.address={cluster.address} with {given[0]} set: a TLS scheduler's address "
                          "starts with tls://; set cluster.address=tls://<host>:<port>")
    if len(given) < len(keys):
        missing = [key for key in keys if key not in given]
        raise ConfigError(f"cluster.address={cluster.address} needs Dask's TLS files; {', '.join(missing)} "
                          f"not set: give {' '.join(f'{key}=<file.pem>' for key in missing)}")
    for key, value in keys.items():
        if not os.access(path := to_absolute_path(value), os.R_OK):
            raise ConfigError(f"{key}={value}: no such readable file ({path}); give the path of a PEM file")


def expand_ensemble(ensemble: DictConfig, run_seed: int) -> list[ModelSpec]:
    """The ensemble's members, each with the ensemble's optimizer, lr_scheduler and loss under its own keys,
    and once per combination of ensemble.grid's values that it has."""
    if not ensemble.models:
        raise ConfigError("no ensemble chosen: add +ensemble=caltech256 (pipeline/conf/ensemble/ has the shipped ones; "
                          "your own: --config-dir <folder> with <folder>/ensemble/<name>.yaml, +ensemble=<name>)")
    shared = {key: OmegaConf.to_container(ensemble[key], resolve=True) if isinstance(ensemble[key], DictConfig)
              else ensemble[key] for key in MEMBER_DEFAULTS}
    for key, default in shared.items():
        if not isinstance(default, dict) or "_target_" not in default:
            raise ConfigError(f"ensemble.{key}={default!r}: give a dict with a _target_ "
                              f"(pipeline/conf/{key}/ has presets)")
    grid = _grid_leaves(OmegaConf.to_container(ensemble.grid, resolve=True), "ensemble.grid")
    found = set()
    models = []
    for index, member in enumerate(ensemble.models):
        fields = OmegaConf.to_container(member, resolve=True)
        where = f"ensemble.models[{index}] ({fields['name']})"
        if not isinstance(fields["model"], dict) or "_target_" not in fields["model"]:
            raise ConfigError(f"{where}.model={fields['model']!r}: give a dict with a _target_, e.g. "
                              "{_target_: pipeline.training.models.resnet, depth: 10, width: 16}")
        for key, default in shared.items():
            fields[key] = _over(default, fields[key])
        axes = [(path, values) for path, values in grid if _has(fields, path)]
        found.update(path for path, _ in axes)
        for combination in itertools.product(*(values for _, values in axes)):
            spec = copy.deepcopy(fields)
            suffix = ""
            for (path, _), value in zip(axes, combination):
                _set(spec, path, value)
                suffix += f"_{path[-1]}{value:g}" if isinstance(value, float) else f"_{path[-1]}{value}"
            spec["name"] += suffix
            spec["seed"] = member_seed(run_seed, spec["name"]) if spec["seed"] is None else spec["seed"]
            models.append(ModelSpec(**spec))
    unused = [".".join(path) for path, _ in grid if path not in found]
    if unused:
        raise ConfigError(f"ensemble.grid.{unused[0]}: no member has the key {unused[0]}; name a key of a "
                          "member's model, optimizer, lr_scheduler or loss, e.g. ensemble.grid.optimizer.lr")
    names = [m.name for m in models]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"ensemble.models: the name {duplicates[0]!r} is used twice; names must be unique")
    return models


def check_objective(objective: DictConfig, models: list[ModelSpec]) -> None:
    names = [m.name for m in models]
    if objective.of not in (ENSEMBLE, BEST_MEMBER, *names):
        raise ConfigError(f"objective.of={objective.of}: no member has that name; give {ENSEMBLE}, {BEST_MEMBER} "
                          f"or a member's name ({', '.join(names)})")


def check_sweeper(objective: DictConfig, sweeper: DictConfig | None) -> None:
    """A multirun's sweeper (its Hydra config, hydra.sweeper) that optimises what the jobs return does so
    the way the objective's metric is better: Optuna's default, minimize, would search for the worst
    accuracy and report it as the best."""
    declared = sweeper_direction(sweeper)
    metric = Metric(objective.metric)
    if declared and declared[2] != metric.direction:
        key, value, direction = declared
        suited = next(m for m in Metric if m.direction == direction)  # what the sweeper's way fits
        raise ConfigError(
            f"{key}={value}: the sweeper would {direction} what each job returns, but objective.metric={metric} "
            f"is better when {'higher' if metric.direction == 'maximize' else 'lower'}; set {key}={_flipped(value)}, "
            f"or objective.metric={suited}")


def swept(cfg: DictConfig, key: str) -> bool:
    """Whether a multirun's jobs may differ at `key`: a sweep on the command line of it, of a node above it,
    or of what may set it and is not a key of this config (a config group: +experiment=a,b), or a search
    space the sweeper's own config declares holding it (Optuna's params, Nevergrad's parametrization, Ax's
    ax_config.params)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    task = OmegaConf.to_container(cfg.hydra.overrides.task, resolve=False)  # as Hydra reads them: ${...} kept
    groups, absent = set(OmegaConf.select(cfg, "hydra.runtime.choices") or {}), object()
    for override in OverridesParser.create().parse_overrides(task):
        name = override.key_or_group
        if override.is_sweep_override() and (key == name or key.startswith(f"{name}.") or name in groups
                                             or OmegaConf.select(cfg, name, default=absent) is absent):
            return True
    return any(key in (OmegaConf.select(cfg, f"hydra.sweeper.{space}") or {})
               for space in ("params", "parametrization", "ax_config.params"))


def sweeper_direction(sweeper: DictConfig | None) -> tuple[str, str, str] | None:
    """(key, its value, "maximize" or "minimize") of a sweeper that optimises one returned value, where its
    config says which way: Optuna's direction, Nevergrad's optim.maximize, Ax's ax_config.experiment.minimize.
    None for a sweeper that optimises nothing (Hydra's basic one) or several values (a list of directions)."""
    if sweeper is None:
        return None
    direction = OmegaConf.select(sweeper, "direction")
    direction = getattr(direction, "name", direction)  # Optuna's Direction enum, or its name
    if direction in ("maximize", "minimize"):
        return "hydra.sweeper.direction", direction, direction
    for key, maximizes in (("optim.maximize", True), ("ax_config.experiment.minimize", False)):
        value = OmegaConf.select(sweeper, key)
        if isinstance(value, bool):
            return f"hydra.sweeper.{key}", str(value).lower(), "maximize" if value == maximizes else "minimize"
    return None


def _flipped(value: str) -> str:
    return {"maximize": "minimize", "minimize": "maximize", "true": "false", "false": "true"}[value]


MEMBER_DEFAULTS = ("optimizer", "lr_scheduler", "loss")  # declared once for the ensemble, refined per member


def _over(default: dict, own: dict) -> dict:
    """A member's config: its own keys over the ensemble's, unless it names another _target_."""
    if own.get("_target_", default["_target_"]) != default["_target_"]:
        return own
    return {**default, **own}


def _grid_leaves(grid, key: str, path: tuple = ()) -> list[tuple[tuple, list]]:
    """ensemble.grid's axes, as (path of a member key, its values)."""
    if isinstance(grid, list):
        if not grid:
            raise ConfigError(f"{key}=[]: give at least one value")
        return [(path, grid)]
    if not isinstance(grid, dict):
        raise ConfigError(f"{key}={grid!r}: give a list of values, e.g. ensemble.grid.optimizer.lr=[0.1,0.01]")
    return [leaf for name, sub in grid.items() for leaf in _grid_leaves(sub, f"{key}.{name}", path + (name,))]


def _has(fields: dict, path: tuple) -> bool:
    for name in path:
        if not isinstance(fields, dict) or name not in fields:
            return False
        fields = fields[name]
    return True


def _set(fields: dict, path: tuple, value) -> None:
    for name in path[:-1]:
        fields = fields[name]
    fields[path[-1]] = value


def check_output_dir(path: Path, fresh: bool) -> None:
    """The run's folder: writable, written by no other run going on now (two runs started in the same second
    get Hydra's same default folder; a resume= of a run still going), and for a `fresh` run (not resume=)
    holding no earlier run's outputs, which the run would overwrite and whose checkpoints it would mix with
    its own (the older run's best one kept as this run's, this run's pruned as older). From here the folder
    is this process's (its RUN_LOCK held) until release_output_dir, or the process's end, however it ends."""
    path = path.resolve()
    if path not in _claimed:
        _claimed[path] = _lock_folder(path)
    if fresh and (held := earlier_run(path)):
        release_output_dir(path)  # not this run's: a process that goes on (a launcher's) must not hold it
        raise ConfigError(f"{path} holds an earlier run ({held}): give this run a folder of its own "
                          "(hydra.run.dir, or hydra.sweep.dir for -m), remove that one to train there anew, or "
                          f"continue a stopped run with resume={path}")


def _lock_folder(path: Path) -> IO | None:
    """`path`'s RUN_LOCK, locked by this process and holding its pid (None on a filesystem without locks).
    A run removes the file as it ends, while it holds it (release_output_dir): the file opened here may be
    one so removed and then let go, whose lock holds nothing, so it counts only while the path names it."""
    for _ in range(LOCK_TRIES):
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock = open(path / RUN_LOCK, "a+")
        except OSError as err:
            raise ConfigError(f"cannot write the run's output directory {path} ({err.strerror}); "
                              "set hydra.run.dir (or hydra.sweep.dir for -m) to a writable folder") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip()
            lock.close()
            raise ConfigError(f"{path} is the folder of a run going on now{f' (pid {holder})' if holder else ''}: "
                              "give each run a folder of its own (hydra.run.dir, or hydra.sweep.dir for -m; runs "
                              "started in the same second get the same default one), or wait for that run to "
                              "end") from None
        except OSError as err:
            lock.close()
            if err.errno == errno.ESTALE:  # NFS: the file was removed by the run that held it
                continue
            return None  # a filesystem without locks (some NFS, Lustre without -o flock): nothing to hold
        if _names(path / RUN_LOCK, lock):
            lock.seek(0)
            lock.truncate()
            lock.write(f"{os.getpid()}\n")
            lock.flush()
            return lock
        lock.close()  # removed by the run that held it: lock the folder's file as it is now
    raise ConfigError(f"{path / RUN_LOCK} was removed each of {LOCK_TRIES} times this run locked it: runs keep "
                      "starting and ending in this folder; give this run a folder of its own (hydra.run.dir, or "
                      "hydra.sweep.dir for -m)")


def _names(path: Path, file: IO) -> bool:
    """Whether `path` is the file `file` has open (not one removed since, or another made in its place)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(file.fileno())
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def release_output_dir(path: Path) -> None:
    """The run in `path` (check_output_dir) is over: another may write there. Its lock file goes, removed
    while held, so that a folder holds only what its runs made (a run killed leaves it, still free)."""
    path = path.resolve()
    lock = _claimed.pop(path, None)
    if lock is not None:
        with contextlib.suppress(OSError):  # the folder gone, or made read-only: only the file stays
            if _names(path / RUN_LOCK, lock):
                (path / RUN_LOCK).unlink()
        lock.close()


@atexit.register
def _release_all_output_dirs() -> None:
    """However the process ends, but killed: what it still holds (a multirun's folder, whose on_multirun_end
    Hydra skips once a job failed) is let go."""
    for path in list(_claimed):
        release_output_dir(path)


def earlier_run(path: Path) -> str:
    """What `path` holds of an earlier run's outputs, named ("" for none)."""
    return ", ".join(name for name in RUN_OUTPUTS if (path / name).exists())
