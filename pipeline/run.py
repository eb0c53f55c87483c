"""One run, from composed config to results.json: the parts every mode shares
(output folder, ensemble, dataset, stage graph), then training (`mode=train`:
device slots, scheduler, Dask, driver) or the profiling pass (`mode=profile`,
pipeline/report/profile_run.py), then results.json, the summary and the
report. The run owns what it starts (cluster, trainer processes, shared
memory) and closes it whatever happens; a stop request (Ctrl-C, SIGTERM:
StopSignals) ends it in order, and `resume=<run folder>` continues it."""
from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Literal

import psutil
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pipeline.config import (STATE_DIR, ConfigError, Mode, check, check_objective, check_output_dir,
                             expand_ensemble, release_output_dir)
from pipeline.data.dataset import DatasetError, DatasetInfo, prepare_dataset
from pipeline.data.executor import (Executor, TlsFiles, cache_kept, connect, dask_client, dask_performance_report,
                                    in_flight_window, node_threads, worker_count)
from pipeline.data.graph import StageGraph, build_graph
from pipeline.delivery.collective import exchange_bytes
from pipeline.runtime.hang import Patience
from pipeline.measure.objective import objective_record
from pipeline.measure.recorder import RunRecorder, write_json
from pipeline.measure.tracking import MlflowRuns, Tracker, launch_relative
from pipeline.orchestration.devices import (DeviceKind, most_sub_slots, resolve_device, slot_devices,
                                           slot_memory_bytes, trainer_threads)
from pipeline.orchestration.group_plan import (ModelSize, check_group_memory, check_host_memory, choose_sharing,
                                             choose_sub_slots, measure_sizes, plan_groups, with_measured_peaks)
from pipeline.orchestration.driver import Convergence, Driver, RunContext
from pipeline.orchestration.flotilla import DeliverySetup
from pipeline.runtime.lifetime import (SHM_DIR, RunConsole, StopSignals, children_context, remove_stale_files,
                                       standard_start_method)
from pipeline.orchestration.link import Link
from pipeline.orchestration.agent import NodeAgents, agent_key, agent_rates, registered_agents
from pipeline.report import write_report
from pipeline.report.build import DASK_REPORT
from pipeline.report.profile_run import profile_run
from pipeline.report.summary import print_summary
from pipeline.scheduler import POLICIES, Cluster, Policy, RatesMeasured, RateTable, Scheduler, make_policy
from pipeline.scheduler.cluster import Slot
from pipeline.scheduler.slot_groups import Grouping
from pipeline.scheduler.halving import Halving
from pipeline.scheduler.policies import PolicyName
from pipeline.scheduler.topology import Topology
from pipeline.training.memory import measure_peaks
from pipeline.training.rates import Measurement, RateHost, format_table, measure_rate_table, save_table
from pipeline.training.group import GroupSpec
from pipeline.training.members import ModelSpec, check_members, flatten, grouped
from pipeline.training.trainer import TrainingSetup
from stages.base import Batch, Split
from stages.cache import GB

PROBE_BATCHES = 3  # batches timed on one node before the first plan (FLEET policies; auto on several nodes)
# Keys a resumed run may set differently from the run it continues; any other difference is refused.
RESUME_MAY_CHANGE = ("resume", "timeouts", "rates.cache")


@dataclass(frozen=True)
class RunInputs:
    """What every mode starts from."""

    models: list[ModelSpec]
    dataset: DatasetInfo
    graph: StageGraph
    cache_line: str | None  # what the cache stage will hold (none without one), checked against the memory
    total_steps: int  # the run's training steps (epochs x batches an epoch): the learning-rate schedules' length

    def dataset_summary(self, name: str, skipped: set[str]) -> dict:
        """What results.json says of the dataset, given the files that could not be used (`skipped`, paths)."""
        source = self.graph.source
        return {"name": name, "root": str(self.dataset.root), "synthetic": self.dataset.synthetic,
                "classes": len(source.class_names), "class_names": source.class_names,  # in label order
                "train_images": source.num_items(Split.TRAIN), "val_images": source.num_items(Split.VAL),
                "split": source.split.summary(),
                "unread_folders": source.unread,
                "unread_rows": source.unread_rows,
                "classes_without_training_images": source.classes_without(Split.TRAIN, skipped)}


def run(cfg: DictConfig, output_dir: Path, stop: StopSignals | None = None,
        parts: dict[str, list[str]] | None = None) -> dict:
    """Run the configured mode; write results.json and the report into `output_dir` (with resume=,
    into the run folder it names). `stop`: the installed signal handlers (none: a run is not stopped).
    `parts`: sub-ensembles whose accuracy and loss results.json gives beside the whole's (`parts`), by
    name (a shared sweep run's jobs: pipeline/sharing.py)."""
    started = time.perf_counter()
    standard_start_method()  # before any process starts: a launcher's worker may have set its own
    console = RunConsole()
    stop = stop or StopSignals()
    if cfg.resume:
        output_dir = _resumed_folder(cfg)
    check_output_dir(output_dir, fresh=not cfg.resume)  # the folder is this run's until it returns
    try:
        return _run_in(output_dir, cfg, console, stop, parts, started)
    finally:
        release_output_dir(output_dir)


def _run_in(output_dir: Path, cfg: DictConfig, console: RunConsole, stop: StopSignals,
            parts: dict[str, list[str]] | None, started: float) -> dict:
    """run, once its folder is checked and its own."""
    check(cfg)
    # This host starts a local run's children: their fork server imports torch on another core while this
    # process checks and plans. (With cluster.address, the agents, asked later, may start them: the first
    # child this host starts then starts the server.)
    if cfg.mode == Mode.train and not cfg.cluster.address:
        children_context()
    left = remove_stale_files()
    if left:
        console.print(f"[yellow]note[/] removed {len(left)} entries that killed runs left in /dev/shm and "
                      f"{tempfile.gettempdir()}")
    inputs = prepare_inputs(cfg)
    try:
        if cfg.mode == Mode.profile:
            if inputs.cache_line:
                console.print(inputs.cache_line)
            results = profile_run(cfg, inputs.models, inputs.graph, inputs.total_steps, output_dir, console)
        else:
            results = train(cfg, inputs, output_dir, console, stop, parts)
            results["objective"] = objective_record(results, cfg.objective)
    finally:
        inputs.dataset.release()  # trained: a run after it may make its stand-in anew
    skipped = {entry["path"] for entry in results["skipped"]}
    results.update({"dataset": inputs.dataset_summary(cfg.dataset.name, skipped),
                    "wall_s": time.perf_counter() - started,
                    "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)})
    write_json(output_dir / "results.json", results)
    print_summary(console, results)
    report = write_report(results, output_dir)
    console.print(report.summary)
    console.print(f"results: {output_dir / 'results.json'}   report: {report.html}" +
                  (f"   checkpoints: {output_dir / 'checkpoints'}" if cfg.mode == Mode.train else ""))
    for model in results.get("given_up", []):
        console.print(f"[red]given up[/]: {model} failed more than scheduler.max_failures="
                      f"{cfg.scheduler.max_failures} times (its failures are in results.json)")
    remove_stale_files()  # hand-off files of this run's hubs, all gone by now
    return results


SAMPLE = 32  # files decoded before the run: that some can be used, and the decoded dataset's size
CACHE_SHARE_OF_SHM = 0.8  # of /dev/shm's free space: the rest is the rings' and hand-off files'
CACHE_SHARE_OF_RAM = 0.5  # of the memory available: the rest is the trainers' and workers'


def _usable_sample(graph: StageGraph) -> Batch:
    """SAMPLE files spread over the dataset, decoded (StageGraph.sample); where none can be used (a folder of
    HEIC photos, of files not fetched), the run would skip every file and train on nothing: an error
    naming why, before anything starts."""
    batch, ctx = graph.sample(SAMPLE)
    if len(batch.labels) or not ctx.skipped:
        return batch
    said = "; ".join(f"{path}: {reason}" for path, reason in ctx.skipped[:3])
    raise DatasetError(f"dataset.root {graph.source.root}: none of the {len(ctx.skipped)} files sampled across it "
                       f"can be used ({said}{'; ...' if len(ctx.skipped) > 3 else ''}), so the run would skip every "
                       "file and train on nothing: give it files it can read (images Pillow decodes: JPEG, PNG, "
                       "WebP, TIFF, BMP), or set dataset.root to them")


def _plan_cache(cfg: DictConfig, graph: StageGraph, sample: Batch) -> str | None:
    """The line that says what the graph's cache stage will hold, once checked against this host's
    memory: the decoded dataset's size is estimated from a sample, and the cache takes at most that.
    A budget this host cannot hold for its nodes is lowered to what it can, and the line says so."""
    cache = graph.cache
    if cache is None:
        return None
    key = f"pipeline.stages.{graph.cache_name}.budget_gb"
    if not cache.budget_bytes:
        return f"[bold]cache[/]    off ({key}=0): every epoch reads and decodes every file"
    source = graph.source
    files = source.num_items(Split.TRAIN) + source.num_items(Split.VAL)
    dataset = (graph.cached_bytes_per_item(sample) or 0) * files
    size = f"{_gb(dataset)} (estimated from {len(sample.labels)} files)"
    nodes_here = 0 if cfg.cluster.address else cfg.cluster.nodes  # other hosts' memory is not known here
    shm, ram = shutil.disk_usage(SHM_DIR).free, psutil.virtual_memory().available
    room, short = min((CACHE_SHARE_OF_SHM * shm, f"{CACHE_SHARE_OF_SHM:.0%} of the {_gb(shm)} free in {SHM_DIR}"),
                      (CACHE_SHARE_OF_RAM * ram, f"{CACHE_SHARE_OF_RAM:.0%} of the {_gb(ram)} of memory available"))
    if nodes_here and min(cache.budget_bytes, dataset) * nodes_here > room:
        asked = cache.budget_gb
        cache.budget_gb = room / nodes_here / GB
        return (f"[bold yellow]cache[/]    on, lowered: {key}={asked:g} per node, but this host allows "
                f"{_gb(room / nodes_here)} for each of its {nodes_here} node(s) ({short}): it holds about "
                f"{min(1.0, cache.budget_bytes / dataset):.0%} of the decoded dataset, {size}; give the host more "
                "(docker: --shm-size) to hold all, or set pipeline.cache_gb (0 turns the cache off)")
    if dataset <= cache.budget_bytes:
        return (f"[bold]cache[/]    on: the decoded dataset, {size}, fits {key}={cache.budget_gb:g} per node; "
                "epochs after the first neither read nor decode")
    return (f"[bold]cache[/]    on, partly: {key}={cache.budget_gb:g} per node holds about "
            f"{cache.budget_bytes / dataset:.0%} of the decoded dataset, {size}; the rest is read and decoded "
            "every epoch (raise it to hold all)")


def _gb(size: float) -> str:
    return f"{size / GB:.2f} GB" if size >= GB / 10 else f"{size / 2**20:.0f} MB"


def planned(folder: Path) -> bool:
    """Whether the run in `folder` got as far as its plan (its state is written before anything trains)."""
    return (Path(folder) / STATE_DIR / "run.json").is_file()


def run_of(folder: Path, cfg: DictConfig) -> Literal["stopped", "finished"] | None:
    """What `folder` holds of a training run of `cfg` (as resume= compares them): "stopped" (stopped, or
    crashed after its plan: resume= continues it), "finished", or None (no run, or one of another config).
    How the shared launcher goes on with a sweep launched again into its folder."""
    if not planned(folder) or _differences(folder, cfg):
        return None
    results = Path(folder) / "results.json"
    return "finished" if results.is_file() and "interrupted" not in json.loads(results.read_text()) else "stopped"


def _differences(folder: Path, cfg: DictConfig) -> list[str]:
    """The settings in which the planned run in `folder` differs from `cfg`, as `key=then (now ...)`, beyond
    the ones a resumed run may change."""
    saved = flatten(json.loads((folder / STATE_DIR / "run.json").read_text())["config"])
    current = flatten(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    return [f"{key}={saved.get(key)!r} (now {current.get(key)!r})" for key in sorted(saved.keys() | current.keys())
            if not key.startswith(RESUME_MAY_CHANGE) and saved.get(key) != current.get(key)]


def _resumed_folder(cfg: DictConfig) -> Path:
    """The folder `resume=` names, checked: it holds a stopped run's state, and that run's config is this one."""
    folder = Path(to_absolute_path(cfg.resume))
    if cfg.mode != Mode.train:
        raise ConfigError(f"resume={cfg.resume}: only training runs resume (mode={cfg.mode}); drop resume=")
    if not planned(folder):
        raise ConfigError(f"resume={cfg.resume}: {folder / STATE_DIR / 'run.json'} is missing: give the folder of a "
                          "training run that was stopped or crashed after it began training (the folder its stop "
                          "message names)")
    differ = _differences(folder, cfg)
    if differ:
        raise ConfigError(f"resume={cfg.resume}: that run had {', '.join(differ[:5])}; resume with the same config "
                          f"(only {', '.join(RESUME_MAY_CHANGE)} may change)")
    return folder


def _check_slots_kept(resume: str, state_dir: Path, slots: dict[Slot, str]) -> None:
    """A stopped run's flotillas form again on the slots they had: the machine must still offer them (with
    trainer.slots=auto, a host with fewer GPUs, or CUDA_VISIBLE_DEVICES naming fewer, does not)."""
    driver = state_dir / "driver.json"
    if not driver.is_file():  # stopped before its scheduler began: nothing holds a slot
        return
    held = json.loads(driver.read_text())["scheduler"]["slots"]
    if any(Slot(*map(int, key.split("/"))) not in slots for key in held):
        raise ConfigError(f"resume={resume}: that run trained on {len(held)} slots, and here are {len(slots)}: resume "
                          "it where its devices are (trainer.slots=auto counts the GPUs this host shows: "
                          "CUDA_VISIBLE_DEVICES; with node agents, each host's)")


@dataclass(frozen=True)
class TrainingPlan:
    """What mode=train decides before it starts anything (plan_training): the hosts and slots, who
    shares a slot, the rates measured, and how members train and converge. `train` carries it out."""

    agents: dict[int, dict]  # node -> its host's agent (python -m pipeline.node); none: every node here
    agent_key: bytes | None  # the secret the driver and agents share (with agents only)
    tls: TlsFiles | None
    device_kind: DeviceKind
    slots: dict[Slot, str]  # slot -> its device
    workers: int | str  # the local cluster's worker processes, or "remote"
    sizes: dict[str, ModelSize]
    groups: list[GroupSpec]  # the slot groups, checked against a slot's memory
    table: RateTable | None  # measured rates (policies that need them; a resumed run's are in its state)
    policy: Policy
    setup: TrainingSetup
    convergence: Convergence
    measured: dict  # what planning measured or decided, for results.json (rates, fusion, GPU memory peaks)


def prepare_inputs(cfg: DictConfig) -> RunInputs:
    """What every mode starts from: the ensemble's members, checked; the dataset (made, when synthetic);
    the stage graph, and what its cache will hold."""
    models = expand_ensemble(cfg.ensemble, cfg.seed)
    check_objective(cfg.objective, models)
    d = cfg.dataset
    dataset = prepare_dataset(d.root, d.synthetic, d.synthetic_classes, d.synthetic_images_per_class,
                              d.synthetic_difficulty)
    try:
        graph = _graph(cfg, models, dataset.root)
        sample = _usable_sample(graph)
        total_steps = cfg.trainer.epochs * graph.source.num_batches(Split.TRAIN)
        models = check_members(models, len(graph.source.class_names), graph.image_sizes, total_steps,
                               cfg.trainer.precision)
        return RunInputs(models, dataset, graph, _plan_cache(cfg, graph, sample), total_steps)
    except BaseException:
        dataset.release()
        raise


def plan_training(cfg: DictConfig, inputs: RunInputs, output_dir: Path, console: Console) -> TrainingPlan:
    """mode=train's plan, from the config: the run's first lines say it, and a new run's state folder
    keeps it for resume= (a resumed run reads its groups back: measuring again might form others)."""
    models, graph = inputs.models, inputs.graph
    tls = TlsFiles.configured(cfg.cluster.tls)
    agents = _node_agents(cfg, tls)
    if graph.cache:  # a host's store belongs to a process of that host: its agent
        graph.cache.node_owners = {node: agent["pid"] for node, agent in agents.items()}
    key = agent_key(cfg.cluster.agent_key_file, "cluster.agent_key_file") if agents else None
    device_kind, slots, _ = _devices(cfg, models, agents)

    def laid_out(n: int):  # the devices, slots and a slot's memory with n processes on each device
        return _devices(cfg, models, agents, n, len(slots) * n // cfg.trainer.slots_per_device)

    workers = "remote" if cfg.cluster.address else worker_count(cfg.cluster.workers)
    _print_header(console, cfg, inputs, device_kind, len(slots), workers)
    state_dir = output_dir / STATE_DIR
    measured: dict = {}
    sizes = _sizes(models, graph, cfg.pipeline.batch_size, device_kind)
    if cfg.resume:
        saved = json.loads((state_dir / "run.json").read_text())
        groups = [GroupSpec(**{**g, "members": tuple(ModelSpec(**m) for m in g["members"])}) for g in saved["groups"]]
        measured.update(saved["results"])
        table = None
        # states saved before grouping=auto chose sub-slots have none: the configured count
        per_device = saved.get("slots_per_device", cfg.trainer.slots_per_device)
    else:
        with agent_rates(agents, key, Link(cfg.timeouts.host_s, tls)) as where:  # node 0's agent measures, if any
            groups, table, per_device = _group(cfg, models, graph, sizes, device_kind, slots, lambda n: laid_out(n)[2],
                                               POLICIES[cfg.scheduler.policy].needs_rates, output_dir, console,
                                               measured, where)
    if per_device != cfg.trainer.slots_per_device:  # grouping=auto measured more processes on a device faster
        device_kind, slots, _ = laid_out(per_device)
    if cfg.resume:
        _check_slots_kept(cfg.resume, state_dir, slots)
    if device_kind == DeviceKind.cuda and not agents:  # (an agent's host is not known here)
        trainers_share = (1 - CACHE_SHARE_OF_RAM) * psutil.virtual_memory().available
        check_host_memory(groups, sizes, len(slots), int(trainers_share))
    if table is not None:
        console.print(format_table(table))
        measured["rates"] = {name: list(rates) for name, rates in table.rates.items()}
        measured["rate_starts_s"] = table.starts
    if not cfg.resume:
        state_dir.mkdir(exist_ok=True)
        write_json(state_dir / "run.json", {"config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                                            "groups": [asdict(g) for g in groups], "slots_per_device": per_device,
                                            "results": dict(measured)})
    s, metric = cfg.scheduler, cfg.objective.metric
    halving = Halving(s.halving.eta, s.halving.min_epochs, metric, metric.direction == "maximize") \
        if s.halving.eta else None
    setup = TrainingSetup(num_classes=len(graph.source.class_names), total_steps=inputs.total_steps,
                          steps_per_epoch=graph.source.num_batches(Split.TRAIN),
                          threads=trainer_threads(device_kind, cfg.trainer.threads, per_device),
                          precision=cfg.trainer.precision, cuda_graphs=cfg.trainer.cuda_graphs,
                          compile=cfg.trainer.compile, checkpoint_dir=output_dir / "checkpoints",
                          record_checksums=cfg.trainer.record_checksums, consume_only=cfg.trainer.consume_only,
                          collective_s=cfg.timeouts.collective_s)
    return TrainingPlan(agents=agents, agent_key=key, tls=tls, device_kind=device_kind, slots=slots, workers=workers,
                        sizes=sizes, groups=groups, table=table, policy=_policy(cfg, groups), setup=setup,
                        convergence=Convergence(cfg.trainer.epochs, s.target_accuracy, s.patience, s.min_delta,
                                                halving),
                        measured=measured)


def train(cfg: DictConfig, inputs: RunInputs, output_dir: Path, console: Console, stop: StopSignals,
          parts: dict[str, list[str]] | None = None) -> dict:
    """mode=train: the plan (plan_training), then the Dask cluster and the driver that carries it out."""
    plan = plan_training(cfg, inputs, output_dir, console)
    models, graph = inputs.models, inputs.graph
    slots, agents, tls, policy = plan.slots, plan.agents, plan.tls, plan.policy
    results = dict(plan.measured)
    nodes = cfg.cluster.nodes
    s, t = cfg.scheduler, cfg.timeouts
    image_sizes = {m.name: graph.image_sizes[m.input] for m in models}
    recorder = RunRecorder(models, {name: size.params for name, size in plan.sizes.items()}, image_sizes, parts)
    with dask_client(cfg.cluster.address, cfg.cluster.workers, cfg.cluster.threads_per_worker, nodes, tls,
                     cfg.cluster.dashboard) as client, \
            cache_kept(client, graph), \
            dask_performance_report(client, output_dir / DASK_REPORT, console), \
            Tracker(output_dir, models, cfg.tracking.tensorboard,
                    _mlflow(cfg, output_dir, models, console)) as tracker, \
            Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                     console=console) as progress:
        if cfg.cluster.dashboard and not cfg.cluster.address:
            console.print(f"[bold]dashboard[/] {client.dashboard_link}")
        threads_of_node = node_threads(client, nodes)
        threads = sum(threads_of_node.values())
        in_flight = {node: in_flight_window(cfg.cluster.in_flight, count) for node, count in threads_of_node.items()}
        joiners = len(slots) // nodes if policy.join_running else 0  # trainers a node's hub may take in
        delivery = DeliverySetup(scheduler=client.scheduler.address, seed=cfg.seed, on_error=cfg.on_error,
                                 in_flight=in_flight, ring_depth=cfg.delivery.ring_depth, agents=agents,
                                 agent_key=plan.agent_key, tls=tls, drain_s=t.drain_s, exit_s=t.exit_s,
                                 patience=Patience(t.warn_s, t.stall_s), collective_s=t.collective_s,
                                 host_s=t.host_s, join_readers=joiners)
        auto = cfg.topology == Topology.auto
        # The CPU side of the plan: each node's worker threads, and the preprocessing cost per image,
        # probed here and then refreshed from the run's own stage timings after every epoch.
        probed = _probe_seconds_per_image(client, graph, cfg) if policy.needs_rates or (auto and nodes > 1) else None
        cluster = Cluster(nodes, len(slots) // nodes, min(threads_of_node.values()), probed or 0.0)
        scheduler = Scheduler([g.name for g in plan.groups], cluster, policy, seed=cfg.seed,
                              checkpoint_every=s.checkpoint_every, max_failures=s.max_failures, topology=cfg.topology,
                              broadcast_streams=cfg.delivery.broadcast_streams, epochs=cfg.trainer.epochs,
                              images_per_epoch=graph.source.num_items(Split.TRAIN))
        first = []  # a resumed run's come from driver.resume() below
        if not cfg.resume:
            first = scheduler.start(0.0) if plan.table is None else [
                decision for name, rates in plan.table.rates.items()
                for decision in scheduler.handle(RatesMeasured(0.0, name, rates, plan.table.start(name)))]
        context = RunContext(graph=graph, setup=plan.setup, delivery=delivery, recorder=recorder, tracker=tracker,
                             progress=progress, report_s=t.report_s, stop_s=t.stop_s, state_dir=output_dir / STATE_DIR)
        driver = Driver(scheduler, {g.name: g for g in plan.groups}, slots, plan.convergence, context, console,
                        NodeAgents(client, agents))
        if cfg.resume:
            first = driver.resume()
            console.print(f"[bold]resumed[/] {output_dir} at {driver.now():.0f} s of its training: " + ", ".join(
                f"{name} after {state.checkpoint_epoch} epochs ({state.status})"
                for name, state in scheduler.groups.items()))
        stop.defer()
        driver.run(first, stop)
        if stop.requested.is_set() or driver.stranded:  # to be resumed
            tracker.status = "KILLED"
    training_s = driver.now()  # the scheduler's clock: a resumed run's goes on from the stopped one's
    if stop.requested.is_set():
        results["interrupted"] = {"cause": signal.Signals(stop.signum).name, "resume": f"resume={output_dir}"}
    elif driver.stranded:  # hosts were lost: what is left cannot train the rest
        lost = sorted(scheduler.lost)
        results["interrupted"] = {
            "cause": f"lost node {', '.join(map(str, lost))}; no slot left can take {', '.join(scheduler.stranded)}: "
                     "start the lost nodes' agents again (python -m pipeline.node <scheduler> --node <i>)",
            "resume": f"resume={output_dir}", "lost_nodes": lost}
    if driver.given_up:
        results["given_up"] = driver.given_up
    results.update({
        "devices": {"kind": plan.device_kind, "slots": len(slots)},
        "cluster": {"address": cfg.cluster.address or "local", "workers": plan.workers, "threads": threads,
                    "in_flight": max(in_flight.values()),  # a producer's window (nodes differ: the largest)
                    "worker_busy_pct": recorder.worker_busy_pct(training_s)},
        "scheduler": {"policy": cfg.scheduler.policy, "decisions": driver.log,
                      "gantt": [bar.to_json() for bar in driver.gantt.bars],
                      "cluster": {"nodes": nodes, "slots_per_node": cluster.slots_per_node,
                                  "cores_per_node": cluster.cores_per_node,
                                  "prep_seconds_per_image": scheduler.cluster.prep_seconds_per_image},
                      "flotillas": recorder.flotilla_rates()},
        **recorder.as_dict(training_s),
    })
    return results


def _mlflow(cfg: DictConfig, output_dir: Path, models: list[ModelSpec], console: Console) -> MlflowRuns | None:
    t = cfg.tracking
    return MlflowRuns(launch_relative(t.mlflow), t.mlflow_experiment, output_dir, models, console.print) \
        if t.mlflow else None


def _graph(cfg: DictConfig, models: list[ModelSpec], root: Path) -> StageGraph:
    """pipeline.stages as a graph that feeds the models' inputs, its dataset.root `root`: prepare_dataset's,
    read from where the command ran (under hydra.job.chdir=true a job runs in its own folder)."""
    here = OmegaConf.merge(cfg, {"dataset": {"root": str(root)}})
    return build_graph(OmegaConf.to_container(here.pipeline.stages, resolve=True, enum_to_str=True),
                       {m.input for m in models})


def _sizes(models: list[ModelSpec], graph: StageGraph, batch_size: int, device_kind: DeviceKind) -> dict:
    """Each model's weight (group_plan.ModelSize) at the graph's classes and its input's image size."""
    return measure_sizes(models, len(graph.source.class_names), graph.image_sizes, batch_size, device_kind)


def _policy(cfg: DictConfig, groups: list[GroupSpec]) -> Policy:
    """The configured scheduling policy, each group asking for its slots."""
    s = cfg.scheduler
    return make_policy(s.policy, s.min_active_fraction, {g.name: g.slots for g in groups}, s.phase_threshold,
                       s.join_running)


def _group(cfg: DictConfig, models: list[ModelSpec], graph: StageGraph, sizes: dict, device_kind: DeviceKind,
           slots: dict, slot_bytes_of: Callable[[int], int], needs_rates: bool, output_dir: Path, console: Console,
           results: dict, where: RateHost | None = None) -> tuple[list[GroupSpec], RateTable | None, int]:
    """The slot groups (trainer.grouping), checked against a slot's memory (`slot_bytes_of(n)`: with n
    processes on each device), for the policies that need one their rate table (each model measured alone
    first: its cost decides who shares a slot), and the processes on each device (trainer.slots_per_device,
    or more where grouping=auto measured them faster: the slots are then `slots` times that).
    `where`: the host that measures (a node agent's: on one node's devices), else this process."""
    classes = len(graph.source.class_names)
    image_sizes = graph.image_sizes
    batch = cfg.pipeline.batch_size
    exchange = 0
    if device_kind == DeviceKind.cuda and cfg.cluster.nodes > 1:  # a hub on the GPU lends it its exchange buffers
        exchange = exchange_bytes({n: s.item_shape for n, s in graph.sinks.items()}, batch, cfg.cluster.nodes)

    def room(n: int) -> int:  # what a slot's group may use with n processes on a device
        return slot_bytes_of(n) - exchange

    per_device = cfg.trainer.slots_per_device
    slot_bytes = room(per_device)
    alone = [GroupSpec(m.name, (m,)) for m in models]
    # Each model must fit alone on the fewest slots it may get: 1 when the scheduler chooses.
    fewest = [GroupSpec(m.name, (replace(m, slots=1),)) for m in models] if needs_rates else alone
    check_group_memory(fewest, sizes, slot_bytes)
    r = cfg.rates
    # An agent measures on its own host's devices: those of one node's slots (the nodes are alike).
    per_slot = [device for slot, device in slots.items() if slot.node == 0] if where \
        else list(slots.values())
    # A GPU split into sub-slots (trainer.slots_per_device) is one device to measure on, and holds one rank of
    # a model: no model grows data-parallel there (devices.slot_devices).
    devices = list(dict.fromkeys(per_slot)) if device_kind == DeviceKind.cuda else per_slot
    sub_slots = len(devices) < len(per_slot)
    how = Measurement(num_classes=classes, image_sizes=image_sizes, batch_size=batch, device_kind=device_kind,
                      devices=devices, steps=r.steps, warmup=r.warmup,
                      threads=trainer_threads(device_kind, cfg.trainer.threads, per_device),
                      precision=cfg.trainer.precision, cuda_graphs=cfg.trainer.cuda_graphs,
                      compile=cfg.trainer.compile, report_s=cfg.timeouts.report_s, where=where)
    cache = Path(to_absolute_path(r.cache))
    if device_kind == DeviceKind.cuda and where is None:  # the device says what a step holds: a trial's peak
        peaks = measure_peaks(models, how, cache)
        sizes.update(with_measured_peaks(sizes, peaks))  # the caller's sizes too
        results["peak_allocated_bytes"] = peaks
        least, most = _gb(min(peaks.values())), _gb(max(peaks.values()))
        span = least if least == most else f"{least} to {most}"
        console.print(f"[bold]GPU memory[/] of a training step, measured: {span} per model alone on one slot")
        check_group_memory(fewest, sizes, slot_bytes)
    max_slots = 1 if sub_slots else min(r.max_slots, len(devices))
    measured_by: dict = {}  # group -> slot count -> the host and process that measured its rate
    single_rates = measure_rate_table(alone, max_slots, how, cache, measured_by) if needs_rates else None
    grouping = cfg.trainer.grouping
    if grouping == Grouping.auto and cfg.scheduler.policy != PolicyName.shared:
        grouping = Grouping.separate  # policies that take turns share slots over time; pack or fuse on request
    if grouping in (Grouping.auto, Grouping.fuse):
        _say_unfused(models, console)
    groups = plan_groups(models, sizes, len(slots), grouping, single_rates)
    lanes = how.threads if device_kind == DeviceKind.cpu else 1  # units a CPU trainer steps at once
    groups, measured = choose_sharing(groups, grouping, sizes, slot_bytes, lanes, how, cache)
    if measured:
        results["grouping"] = measured
    check_group_memory(groups, sizes, slot_bytes, lanes)
    if grouping == Grouping.auto and per_device == 1 and where is None and all(m.slots == 1 for m in models) \
            and (device_kind == DeviceKind.cpu or cfg.trainer.slots == "auto"):
        def split(n: int) -> tuple[Measurement, int]:
            return replace(how, threads=trainer_threads(device_kind, cfg.trainer.threads, n)), room(n)

        most = most_sub_slots(device_kind, cfg.trainer.threads, len(devices))
        per_device, groups, paces = choose_sub_slots(models, groups, sizes, len(devices), most, split, cache)
        if len(paces) > 1:
            results["sub_slots"] = {"images_per_s": paces, "chosen": per_device}
            console.print("[bold]sub-slots[/] measured, images/s of a device's models in n processes side by side: "
                          + ", ".join(f"n={n} {pace:,.1f}" for n, pace in paces.items())
                          + f"; {per_device} process(es) per device (trainer.grouping=auto)")
    shared = [g for g in groups if len(g.members) > 1]
    for g in shared:
        console.print(f"[bold]{g.name}[/]: {len(g.members)} models {g.mode} on one slot: "
                      + ", ".join(m.name for m in g.members))
    table = None
    if needs_rates:  # the groups of one are in the cache already: only the shared ones are measured now
        table = measure_rate_table(groups, max_slots, how, cache, measured_by)
        save_table(table, output_dir / "rates.json")
        results["rates_measured_by"] = {name: measured_by[name] for name in table.rates}
    return groups, table, per_device


def _say_unfused(models: list[ModelSpec], console: Console) -> None:
    """Members of one module and loss that cannot fuse (they pack instead), and why: vmap's error, or its
    lack of autocast."""
    for family in grouped(models, lambda m: m.family).values():
        if len(family) < 2:
            continue
        for why, members in grouped([m for m in family if m.unfusable], lambda m: m.unfusable).items():
            console.print(f"[yellow]note[/] {', '.join(m.name for m in members)} ({members[0].describe()}) pack, "
                          f"never fuse: {why}")


def _probe_seconds_per_image(client, graph: StageGraph, cfg: DictConfig) -> float | None:
    """Worker seconds per image, measured as a run measures it (RunRecorder.seconds_per_image) on a
    few validation batches of node 0, for the first plan (the scheduler's CPU cap; topology=auto on
    several nodes); later plans use the run's own measurements. The batches it makes stay in the cache."""
    probe = RunRecorder([], {}, {})
    with Executor(client, graph, cfg.seed, cfg.on_error, in_flight=1, node=0, drain_s=cfg.timeouts.drain_s,
                  patience=Patience(cfg.timeouts.warn_s, cfg.timeouts.stall_s)) as executor:
        for index, output in executor.batches(Split.VAL, 0):
            probe.add_batch(output, train=False)
            if index == PROBE_BATCHES - 1:
                break
    return probe.seconds_per_image()


def _node_agents(cfg: DictConfig, tls: TlsFiles | None) -> dict[int, dict]:
    """Node -> the agent of each real host (python -m pipeline.node) registered with the scheduler at
    cluster.address; none: every node's hubs and trainers run here."""
    if not cfg.cluster.address:
        return {}
    with connect(cfg.cluster.address, tls, timeout="20s") as client:
        agents = registered_agents(client)
    if agents and sorted(agents) != list(range(cfg.cluster.nodes)):
        raise ConfigError(f"cluster.nodes={cfg.cluster.nodes} but the scheduler at {cfg.cluster.address} has node "
                          f"agents {sorted(agents)} (python -m pipeline.node --node <i>): set cluster.nodes to their "
                          "count and number them 0, 1, ... without gaps")
    hosts = {(agent["gpus"], agent["gpu_memory"]) for agent in agents.values()}
    if len(hosts) > 1:
        raise ConfigError(f"the node agents' hosts differ in (GPUs, GPU bytes): {sorted(hosts)}; the scheduler "
                          "plans for alike nodes: run the agents on alike hosts")
    return agents


def _devices(cfg: DictConfig, models: list[ModelSpec], agents: dict[int, dict], per_device: int | None = None,
             slots: int | str | None = None):
    """Device slots (slot -> device) and the memory of each, with `per_device` processes on each device
    and `slots` slots (default: trainer.slots_per_device and trainer.slots). With node agents, the GPUs are
    those of their hosts."""
    import torch

    if agents:
        host = next(iter(agents.values()))  # they are alike (_node_agents)
        gpus, gpu_memory = host["gpus"], host["gpu_memory"]
    else:
        gpus = torch.cuda.device_count()
        gpu_memory = torch.cuda.get_device_properties(0).total_memory if gpus else None
    device_kind = resolve_device(cfg.trainer.device, gpus > 0)
    per_device = per_device or cfg.trainer.slots_per_device
    chosen = slot_devices(device_kind, gpus, slots or cfg.trainer.slots, models, cfg.cluster.nodes, bool(agents),
                          per_device)
    return device_kind, chosen, slot_memory_bytes(device_kind, len(chosen), cfg.trainer.slot_memory_gb, gpu_memory,
                                                  per_device)


def _print_header(console: Console, cfg: DictConfig, inputs: RunInputs, device_kind: DeviceKind, slots: int,
                  workers) -> None:
    dataset, graph, models = inputs.dataset, inputs.graph, len(inputs.models)
    source = graph.source
    size = (f"{len(source.class_names)} classes, {source.num_items(Split.TRAIN)} train / "
            f"{source.num_items(Split.VAL)} val images by {source.split}")
    if source.unread:
        shown = ", ".join(source.unread[:3]) + (f" and {len(source.unread) - 3} more" if len(source.unread) > 3 else "")
        size += f"; not read: {len(source.unread)} folder(s) inside class folders ({shown})"
    if source.unread_rows:
        size += "; not read: " + ", ".join(f"{count} rows of split {split}"
                                           for split, count in source.unread_rows.items())
    if dataset.synthetic:
        made = "generated now" if dataset.generated_now else "generated earlier"
        console.print(f"[bold yellow]dataset[/]  SYNTHETIC stand-in for {cfg.dataset.name} ({made}) at "
                      f"{dataset.root}: {size}. No {cfg.dataset.name} was found there; to train on real data "
                      "set dataset.root=/path/to/256_ObjectCategories (any ImageFolder tree, or a CSV file listing images)")
    else:
        console.print(f"[bold]dataset[/]  {cfg.dataset.name} at {dataset.root}: {size}")
    sinks = ", ".join(f"{name} {spec.item_shape[0]}px" for name, spec in graph.sinks.items())
    console.print(f"[bold]scale[/]    {models} models on sinks {sinks}, batch {cfg.pipeline.batch_size}, "
                  f"up to {cfg.trainer.epochs} epochs, scheduler={cfg.scheduler.policy}; paper scale "
                  "(100 models, 224/299 px, GPUs): +ensemble=caltech256_paper scheduler=fleet_g")
    where = f"Dask scheduler {cfg.cluster.address}" if cfg.cluster.address else \
        f"Dask LocalCluster {workers} workers x {cfg.cluster.threads_per_worker} thread"
    per_device = cfg.trainer.slots_per_device
    if device_kind == DeviceKind.cuda:
        what = "GPUs" if per_device == 1 else f"{per_device} trainer processes per GPU, trainer.slots_per_device"
    else:
        what = "no CUDA device in use" + ("" if per_device == 1 else f"; {per_device} trainer processes share "
                                          f"trainer.threads={cfg.trainer.threads}, trainer.slots_per_device")
    console.print(f"[bold]devices[/]  {slots} {device_kind.upper()} slot(s) ({what}); preprocessing on "
                  f"{where}. Change with trainer.device=cuda|cpu, trainer.slots=N, cluster.workers=N, "
                  "cluster.address=tcp://host:8786")
    if inputs.cache_line:
        console.print(inputs.cache_line)
