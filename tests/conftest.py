"""Shared fixtures: small datasets the tests make themselves, and config
composition the way Hydra does it for a run."""
from __future__ import annotations

import os

# Before torch is imported, here and in every process the tests start: oneDNN runs its AVX2 kernels at most,
# so that a suite on an AVX-512 machine meets what AVX2-only CPUs meet (their kernels had a channels-last bug
# no AVX-512 machine saw, issue 29).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import fcntl  # noqa: E402
import multiprocessing
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipeline.config import register
from pipeline.data.synthetic import generate_imagefolder, write_bad_files
from pipeline.training.members import CONF

register()


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """4 classes x 16 photo-sized synthetic JPEGs, split as a dataset a user gives."""
    root = tmp_path_factory.mktemp("data") / "tiny"
    generate_imagefolder(root, num_classes=4, images_per_class=16, seed=3, image_size=(120, 160),
                         val_per_class=None)  # declares no split: the read stage's own (10%)
    return root


@pytest.fixture(scope="session")
def tiny_manifest(tiny_dataset, tmp_path_factory) -> Path:
    """tiny_dataset's images listed in a CSV file elsewhere (paths relative to its folder), split by its
    split column: of each class, 1 test, 3 val and 12 train images."""
    manifest = tmp_path_factory.mktemp("listed") / "images.csv"
    lines = ["path,label,split"]
    for folder in sorted(path for path in tiny_dataset.iterdir() if path.is_dir()):
        for index, image in enumerate(sorted(folder.iterdir())):
            split = "test" if index == 0 else "val" if index <= 3 else "train"
            lines.append(f"{os.path.relpath(image, manifest.parent)},{folder.name},{split}")
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


@pytest.fixture(scope="session")
def bad_dataset(tiny_dataset, tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """The tiny dataset plus one troublesome file of each kind in class 1."""
    root = tmp_path_factory.mktemp("data") / "bad"
    shutil.copytree(tiny_dataset, root)
    bad = write_bad_files(sorted(p for p in root.iterdir() if p.is_dir())[0])
    return root, bad


@pytest.fixture
def open_tmp_path() -> Path:
    """A temporary folder any user may enter (tmp_path's parents admit their owner only)."""
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)
        yield Path(folder)


NOBODY = 65534
AS_NOBODY_S = 120  # as_a_user_permissions_bind's wait for its child's outcome


def as_a_user_permissions_bind(function, *args):
    """What `function(*args)` returns, or the exception it raises, for a user whom file permissions bind:
    this process when it is not root, else a new process that becomes nobody before it calls the function
    (root reads and writes whatever chmod forbids). Spawned, not forked: a fork of this process, which has
    threads, once waited forever in CI, as a fork may on what a thread held as it forked. Files the function
    reads must lie where nobody may go (open_tmp_path); the function and its arguments must pickle."""
    if os.geteuid() != 0:
        try:
            return function(*args)
        except Exception as error:
            return error
    context = multiprocessing.get_context("spawn")
    outcome, sent = context.Pipe(duplex=False)
    child = context.Process(target=_as_nobody, args=(sent, function, args))
    child.start()
    sent.close()
    try:
        if not outcome.poll(AS_NOBODY_S):
            raise TimeoutError(f"{function.__name__} as nobody gave no outcome in {AS_NOBODY_S} s")
        return outcome.recv()
    finally:
        child.kill()
        child.join()


def _as_nobody(sent, function, args):
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        outcome = function(*args)
    except Exception as error:
        outcome = error
    sent.send(outcome)


@pytest.fixture(scope="session")
def tls(tmp_path_factory):
    """A throwaway CA and one certificate it signed (Dask's Security.temporary), as Dask's
    in-memory Security for a test's own scheduler and as the PEM files a run is given."""
    return throwaway_tls(tmp_path_factory.mktemp("tls"))


def throwaway_tls(folder: Path):
    """A CA of its own and a certificate it signed, as the tls fixture gives them, written in `folder`."""
    from distributed import Security

    from pipeline.data.executor import TlsFiles

    security = Security.temporary()
    files = {}
    for name, pem in (("ca", security.tls_ca_file), ("cert", security.tls_client_cert),
                      ("key", security.tls_client_key)):
        files[name] = folder / f"{name}.pem"
        files[name].write_text(pem)
        files[name].chmod(0o600)
    return security, TlsFiles(str(files["ca"]), str(files["cert"]), str(files["key"]))


def member(name: str, *, arch: str = "resnet", depth: int = 10, width: int = 8, growth_rate: int = 12, lr: float = 0.1,
           momentum: float = 0.9, weight_decay: float = 5e-4, slots: int = 1, input: str = "main", seed: int = 0):
    """A member of a built-in family with the shipped defaults (SGD, cosine, cross-entropy); seed 0 for all,
    so that members a test compares start from the same weights."""
    from pipeline.training.members import with_defaults

    model = {"_target_": f"pipeline.training.models.{arch}", "depth": depth, "width": width}
    if arch == "densenet":
        model["growth_rate"] = growth_rate
    return with_defaults(name, model, input, seed, slots, lr=lr, momentum=momentum, weight_decay=weight_decay)


def resnet_override(name: str, input: str = "main", width: int = 8, lr: float | None = None,
                    slots: int | None = None) -> str:
    """A ResNet-10 member as a command-line override writes it, e.g. in ensemble.models=[...]."""
    extra = (f", optimizer: {{lr: {lr}}}" if lr is not None else "") + (f", slots: {slots}" if slots else "")
    return (f"{{name: {name}, input: {input}, model: {{_target_: pipeline.training.models.resnet, depth: 10, "
            f"width: {width}}}{extra}}}")


def compose_config(overrides: list[str], with_hydra: bool = False):
    """The run's config; `with_hydra`: with its `hydra` node too, as a launcher has a job's."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=with_hydra)


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is visible."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_SIDE_BY_SIDE = pytest.StashKey()  # the lock a test holds while it runs beside the other test process's


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The suite runs in two processes (pytest-xdist, pyproject's addopts): each test, fixtures included,
    shares a lock beside the workers' temporary folders, which a test takes for itself where it must run
    alone (the `alone` fixture)."""
    if not hasattr(item.config, "workerinput"):  # one process: nothing runs beside a test
        return (yield)
    with open(Path(item.config.option.basetemp).parent / "side-by-side.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        item.stash[_SIDE_BY_SIDE] = lock
        return (yield)


@pytest.fixture
def remove_stores():
    """Takes a graph made in the test's own process: its cache is closed and its shared memory removed
    once the test is over, whatever way it ends."""
    from pipeline.runtime.lifetime import remove_shm

    graphs = []
    yield graphs.append
    for graph in graphs:
        graph.cache.close()
        for prefix in graph.cache.prefixes():
            remove_shm(prefix)


@pytest.fixture
def alone(request):
    """A context manager: in it, no test runs in the other test process, which waits for the end of it
    (once its own test is over). For a check of what any run on this machine may touch: what dead processes
    left in /dev/shm and the temporary folder, which every run's start removes."""
    @contextmanager
    def section():
        lock = request.node.stash.get(_SIDE_BY_SIDE, None)
        if lock is None:
            yield
            return
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_SH)

    return section
