"""One run, from composed config to results.json: wires the parts together
and owns their lifecycle (cluster, trainer processes, shared memory)."""
from __future__ import annotations

import math
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pipeline.dataset import DatasetInfo, prepare_dataset
from pipeline.executor import Executor, dask_client, worker_count
from pipeline.flotilla import Flotilla
from pipeline.graph import StageGraph, build_graph
from pipeline.planner import Plan, check_memory, plan_single_flotilla, resolve_device, slot_memory_bytes
from pipeline.results import RunRecorder, print_summary, write_json
from pipeline.trainer import ModelSpec
from stages.base import Split


class ConfigError(ValueError):
    pass


def expand_ensemble(ensemble: DictConfig | None) -> list[ModelSpec]:
    """The ensemble's members; with lr_sweep, each model once per learning rate."""
    if ensemble is None or not ensemble.models:
        raise ConfigError("no ensemble chosen: add +ensemble=caltech256 (or another file in conf/ensemble/)")
    models = []
    for model in ensemble.models:
        fields = OmegaConf.to_container(model, resolve=True)
        for lr in ensemble.lr_sweep or [fields["lr"]]:
            name = f"{fields['name']}_lr{lr:g}" if ensemble.lr_sweep else fields["name"]
            models.append(ModelSpec(**{**fields, "name": name, "lr": float(lr)}))
    names = [m.name for m in models]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"ensemble.models: the name {duplicates[0]!r} is used twice; names must be unique")
    return models


def check_output_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write the run's output directory {path} ({err.strerror}); "
                          "set hydra.run.dir (or hydra.sweep.dir for -m) to a writable folder") from None


def run(cfg: DictConfig, output_dir: Path) -> dict:
    started = time.perf_counter()
    console = Console()
    check_output_dir(output_dir)
    if cfg.on_error not in ("skip", "fail"):
        raise ConfigError(f"on_error must be 'skip' or 'fail', got {cfg.on_error!r}")
    models = expand_ensemble(cfg.ensemble)
    d = cfg.dataset
    dataset = prepare_dataset(d.root, d.synthetic, d.synthetic_classes, d.synthetic_images_per_class, cfg.seed)
    graph = build_graph(OmegaConf.to_container(cfg.pipeline.stages, resolve=True), {m.input for m in models})
    plan, params, image_sizes = _plan(cfg, models, graph)
    workers = "remote" if cfg.cluster.address else worker_count(cfg.cluster.workers)
    _print_header(console, cfg, dataset, graph, plan, workers)

    recorder = RunRecorder(plan.flotillas[0], params, image_sizes)
    epochs = cfg.trainer.epochs
    train_batches = graph.source.num_batches(Split.TRAIN)
    with dask_client(cfg.cluster.address, cfg.cluster.workers, cfg.cluster.threads_per_worker) as client, \
            Flotilla(plan.flotillas[0], graph.sinks, graph.source.batch_size, len(graph.source.class_names),
                     epochs, train_batches, cfg.transport.slots, cfg.trainer.threads, output_dir / "checkpoints",
                     cfg.trainer.record_checksums) as flotilla:
        threads = sum(client.nthreads().values())
        in_flight = 2 * threads if cfg.cluster.in_flight == "auto" else cfg.cluster.in_flight
        with Executor(client, graph, cfg.seed, cfg.on_error, in_flight) as executor:
            _train(console, executor, flotilla, recorder, graph, epochs)
        checksums = _finish(console, flotilla, recorder)

    results = {
        "dataset": {"name": d.name, "root": str(dataset.root), "synthetic": dataset.synthetic,
                    "classes": len(graph.source.class_names), "train_images": graph.source.num_items(Split.TRAIN),
                    "val_images": graph.source.num_items(Split.VAL)},
        "devices": {"kind": plan.device_kind, "slots": plan.slots, "trainers": plan.trainers},
        "cluster": {"address": cfg.cluster.address or "local", "workers": workers},
        "epochs": epochs,
        **recorder.as_dict(epochs),
        "wall_s": time.perf_counter() - started,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if cfg.trainer.record_checksums:
        results["delivery"] = {"sent": dict(flotilla.sent_checksums), "received": checksums}
    write_json(output_dir / "results.json", results)
    print_summary(console, results)
    console.print(f"results: {output_dir / 'results.json'}   checkpoints: {output_dir / 'checkpoints'}")
    return results


def _plan(cfg: DictConfig, models: list[ModelSpec], graph: StageGraph) -> tuple[Plan, dict, dict]:
    import torch

    from pipeline.models import build_model, count_parameters, estimate_training_bytes

    device_kind = resolve_device(cfg.trainer.device, torch.cuda.is_available())
    plan = plan_single_flotilla(models, device_kind, torch.cuda.device_count(), cfg.trainer.slots)
    classes = len(graph.source.class_names)
    image_sizes = {m.name: graph.sinks[m.input].item_shape[0] for m in models}
    params, needs = {}, {}
    for m in models:
        model = build_model(m.arch, m.depth, m.width, m.growth_rate, classes, image_size=image_sizes[m.name])
        params[m.name] = count_parameters(model)
        per_slot_batch = math.ceil(cfg.pipeline.batch_size / m.slots)
        needs[m.name] = estimate_training_bytes(model, image_sizes[m.name], per_slot_batch)
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if device_kind == "cuda" else None
    check_memory(plan, needs, slot_memory_bytes(plan, cfg.trainer.slot_memory_gb, gpu_memory))
    return plan, params, image_sizes


def _print_header(console: Console, cfg: DictConfig, dataset: DatasetInfo, graph: StageGraph, plan: Plan,
                  workers) -> None:
    source = graph.source
    size = (f"{len(source.class_names)} classes, {source.num_items(Split.TRAIN)} train / "
            f"{source.num_items(Split.VAL)} val images")
    if dataset.synthetic:
        made = "generated now" if dataset.generated_now else "generated earlier"
        console.print(f"[bold yellow]dataset[/]  SYNTHETIC stand-in for {cfg.dataset.name} ({made}) at "
                      f"{dataset.root}: {size}. No {cfg.dataset.name} was found there; to train on real data "
                      "set dataset.root=/path/to/256_ObjectCategories (any ImageFolder tree)")
    else:
        console.print(f"[bold]dataset[/]  {cfg.dataset.name} at {dataset.root}: {size}")
    streams = ", ".join(f"{name} {spec.item_shape[0]}px" for name, spec in graph.sinks.items())
    console.print(f"[bold]scale[/]    {sum(len(f) for f in plan.flotillas)} models on streams {streams}, "
                  f"batch {cfg.pipeline.batch_size}, {cfg.trainer.epochs} epochs; paper scale (100 models, "
                  "224/299 px, GPUs): +ensemble=caltech256_paper")
    where = f"Dask scheduler {cfg.cluster.address}" if cfg.cluster.address else \
        f"Dask LocalCluster {workers} workers x {cfg.cluster.threads_per_worker} thread"
    console.print(f"[bold]devices[/]  {plan.trainers} trainer(s) on {plan.slots} {plan.device_kind.upper()} slot(s) "
                  f"({'GPUs' if plan.device_kind == 'cuda' else 'no CUDA device in use'}); preprocessing on {where}. "
                  "Change with trainer.device=cuda|cpu, trainer.slots=N, cluster.workers=N, "
                  "cluster.address=tcp://host:8786")


def _train(console: Console, executor: Executor, flotilla: Flotilla, recorder: RunRecorder, graph: StageGraph,
           epochs: int) -> None:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        for epoch in range(epochs):
            for split in (Split.TRAIN, Split.VAL):
                task = progress.add_task(f"epoch {epoch + 1}/{epochs} {split.value}",
                                         total=graph.source.num_batches(split))
                split_started = time.perf_counter()
                for index, output in executor.batches(split, epoch):
                    flotilla.publish(split, epoch, index, output.streams)
                    recorder.add_batch(output, train=split is Split.TRAIN)
                    progress.advance(task)
                    _log_reports(console, flotilla.poll(), recorder)
                    for path, reason in recorder.take_new_skips():
                        console.print(f"[yellow]warning[/] skipped {path}: {reason}")
                if split is Split.TRAIN:
                    recorder.train_wall_s += time.perf_counter() - split_started
                flotilla.end(split, epoch)
        flotilla.stop()


def _log_reports(console: Console, events: list[dict], recorder: RunRecorder) -> None:
    for event in events:
        epoch = recorder.add_report(event)
        if epoch is not None:
            accuracies = ", ".join(f"{r.placement.model.name} {r.val_accuracy[epoch]:.1%}"
                                   for r in recorder.models.values())
            console.print(f"epoch {epoch + 1}: val accuracy {accuracies}; "
                          f"[bold]ensemble {recorder.ensemble_accuracy[epoch]:.1%}")


def _finish(console: Console, flotilla: Flotilla, recorder: RunRecorder) -> dict[str, list]:
    """Waits for every trainer's final reports; returns their checksums."""
    checksums: dict[str, list] = {}
    expected = sum(len(p.devices) for p in flotilla.placements)
    deadline = time.monotonic() + 600
    while len(checksums) < expected:
        if time.monotonic() > deadline or flotilla.dead_trainers():
            raise RuntimeError(f"trainers did not finish: {', '.join(flotilla.dead_trainers()) or 'timed out'}")
        for event in flotilla.poll(timeout=1.0):
            if event["event"] == "done":
                checksums[f"{event['model']}/{event['rank']}"] = event["checksums"]
            else:
                _log_reports(console, [event], recorder)
    flotilla.join(timeout=30)
    return checksums
