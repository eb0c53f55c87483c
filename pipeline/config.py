"""Config schema: the structured config every run is checked against.

Stored in Hydra's ConfigStore as `schema` and named first in conf/config.yaml's
defaults, so a misspelt key or a wrong type fails at composition with the
key's full name. Stage entries under `pipeline.stages` are checked by the
graph builder against each stage's own dataclass (see pipeline/data/graph.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class DatasetConf:
    name: str = "caltech256"  # label used in reports
    root: str = "data/caltech256"  # ImageFolder tree (class folders); relative paths start where you ran the command
    synthetic: str = "auto"  # auto: generate a labelled stand-in when root is missing or empty; never: error instead
    synthetic_classes: int = 10  # classes of the generated stand-in
    synthetic_images_per_class: int = 110  # images per class of the generated stand-in
    val_per_class: float = 0.1  # validation images per class: a fraction if < 1, else a count


@dataclass
class PipelineConf:
    batch_size: int = 64  # images per batch task and per training step (split across a model's slots)
    image_size: int = 64  # output side of the main augment branch
    alt_image_size: int = 48  # output side of the second augment branch
    decode_backend: str = "simplejpeg"  # simplejpeg | pillow | dali
    stages: Dict[str, Any] = field(default_factory=dict)  # the stage DAG: name -> {_target_, inputs, fields}


@dataclass
class ClusterConf:
    address: Optional[str] = None  # tcp://host:8786 uses that Dask scheduler; null starts a LocalCluster here
    workers: Any = "auto"  # LocalCluster worker processes; auto = CPU cores of this machine
    threads_per_worker: int = 1  # batch tasks one worker runs at once (stages are single-threaded)
    in_flight: Any = "auto"  # batch tasks submitted ahead of each producer; auto = 2 x its node's worker threads
    nodes: int = 1  # nodes: LocalCluster workers and trainer slots split into this many simulated nodes
    # (loopback); with address: one agent per host (python -m pipeline.orchestration.node <address> --node <i>), or
    # workers carrying the resource node-<i> (dask worker --resources node-0=1) with hubs and trainers here


@dataclass
class TransportConf:
    slots: int = 4  # batches buffered per stream in shared memory; a slower trainer holds the producer beyond this
    broadcast_groups: int = 2  # multi_broadcast: groups of models, each fed by its own producer at its own pace


@dataclass
class SchedulerConf:
    policy: str = "shared"  # shared (all models at once) | fleet_g | fleet_l | baseline | homogeneous
    min_active_fraction: float = 0.8  # fleet_g/fleet_l: a flotilla stops when fewer of its slots are active
    target_accuracy: Optional[float] = None  # a model converges on reaching this validation accuracy
    patience: int = 0  # ...or after this many epochs without improving its best by min_delta (0: off)
    min_delta: float = 0.005  # the smallest gain in validation accuracy that counts
    profile_max_slots: int = 2  # profiling measures each model on 1..this many slots (one node at most)
    profile_steps: int = 5  # timed training steps per profile measurement
    profile_warmup: int = 2  # untimed steps first
    profile_cache: str = "outputs/profile_cache.json"  # measured rates, keyed by model and hardware


@dataclass
class TrainerConf:
    epochs: int = 4  # the most epochs a model trains (it may converge earlier: scheduler.*)
    device: str = "auto"  # auto (CUDA if present) | cuda | cpu
    slots: Any = "auto"  # device slots: auto = every GPU, or on CPU one slot per model slot requested
    threads: int = 1  # torch threads per CPU trainer process
    slot_memory_gb: Optional[float] = None  # memory one slot may use; null: the GPU's, or RAM / slots on CPU
    record_checksums: bool = False  # trainers report a CRC of every message received (delivery tests)
    consume_only: bool = False  # trainers take each batch and train nothing: measures delivery alone


@dataclass
class ModelConf:
    name: str = MISSING  # unique name, used for checkpoints and reports
    arch: str = MISSING  # resnet | densenet
    depth: int = 10  # resnet: 10/18/34; densenet: 40/64/100 (BC, 3 blocks) or 121/169/201
    width: int = 16  # resnet: first stage's channels; densenet: stem channels
    growth_rate: int = 12  # densenet: channels each layer adds
    input: str = MISSING  # the sink stage whose stream it trains on
    lr: float = 0.05  # SGD learning rate (cosine-annealed over the epochs)
    momentum: float = 0.9  # SGD momentum
    weight_decay: float = 5e-4  # SGD weight decay
    slots: int = 1  # device slots it trains on, data-parallel (DDP) when > 1


@dataclass
class EnsembleConf:
    models: List[ModelConf] = field(default_factory=list)  # the ensemble's members
    lr_sweep: List[float] = field(default_factory=list)  # if set, every model is trained once per learning rate


@dataclass
class Config:
    mode: str = "train"  # train | profile (a short profiling pass that writes the report, no training)
    topology: str = "auto"  # how batches reach a flotilla's trainers: auto | single_broadcast | all_shared |
    # multi_broadcast | duplicated (docs/topologies.md)
    seed: int = 0  # fixes shuffling and augmentation, whatever the number of workers
    on_error: str = "skip"  # a bad data file: skip (counted and listed) | fail (stop naming it)
    dataset: DatasetConf = field(default_factory=DatasetConf)
    pipeline: PipelineConf = field(default_factory=PipelineConf)
    cluster: ClusterConf = field(default_factory=ClusterConf)
    transport: TransportConf = field(default_factory=TransportConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    scheduler: SchedulerConf = field(default_factory=SchedulerConf)
    ensemble: Optional[EnsembleConf] = None  # chosen with +ensemble=<name>


def register() -> None:
    ConfigStore.instance().store(name="schema", node=Config)
