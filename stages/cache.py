"""Cache stage: the decoded images of a node kept in its shared memory across epochs.

Declared in the DAG after decode and before the random augmentations (which
change every epoch), it holds decode's exact output, at the reduced DCT scale
the branches need: epochs after the first read and decode only the files it
does not hold, and their batches are bit-identical to an uncached run's.

Each node (a host, or a simulated node) has one store in /dev/shm, shared by
its Dask workers:
* an image is one file, written under a temporary name and published by a
  hard link that fails if the name exists: a worker killed mid-write costs a
  recomputation, never a wrong batch, and an image two workers decoded at once
  is kept once;
* a ledger of the bytes held (tmpfs pages), updated under flock, keeps the
  store within its budget: what fits is cached and kept, nothing is evicted
  (CoorDL's MinIO policy: every epoch visits every file in a new order, so any
  eviction would only trade one miss for another).
Names are ensemble-<owner pid>-cache-<run token>-n<node>-...: the owner is the
run's driver, or the node agent serving that host, so what a run killed
outright leaves is removed like its other shared memory (pipeline/runtime/lifetime.py).
"""
from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import secrets
import struct
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from pipeline.runtime.files import written_whole
from stages.base import Batch, BatchContext, DataKind, Role, Spec, Stage, StageError

SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE  # tmpfs holds whole pages: what the ledger counts
HEADER = struct.Struct("<4sIII")  # magic, height, width, channels; then the image's bytes
MAGIC = b"EIC1"
GB = 1024**3
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def cache_prefix(owner: int) -> str:
    """The start of the names of every cache store `owner` owns."""
    return f"ensemble-{owner}-cache-"


def stored_bytes(image: np.ndarray) -> int:
    """The shared memory an image takes in a store: its file's pages."""
    return -(-(HEADER.size + image.nbytes) // PAGE) * PAGE


@dataclass
class Cache(Stage):
    """Keeps its input (decoded images) in each node's shared memory, up to `budget_gb` per node."""

    budget_gb: float  # shared memory a node's store may take; 0 turns the cache off

    role: ClassVar[Role] = Role.MAP
    accepts: ClassVar[DataKind | None] = DataKind.IMAGES
    same_every_epoch: ClassVar[bool] = True

    consumer_side: int | None = field(init=False, default=None)  # passed on to decode (set by the graph)
    token: str = field(init=False, default_factory=lambda: secrets.token_hex(8))  # this run's stores: unguessable
    owner: int = field(init=False, default_factory=os.getpid)  # the driver, where the graph is built
    node_owners: dict[int, int] = field(init=False, default_factory=dict)  # node -> its agent's pid, on real hosts

    def __post_init__(self) -> None:
        if not self.budget_gb >= 0:
            raise StageError(f"budget_gb must be >= 0 (0 turns the cache off), got {self.budget_gb}")

    @property
    def budget_bytes(self) -> int:
        return int(self.budget_gb * GB)

    def output_spec(self, input_spec: Spec | None) -> Spec:
        return Spec(DataKind.IMAGES)

    def set_consumer_need(self, side: int | None) -> None:
        self.consumer_side = side

    def min_input_side(self) -> int | None:
        return self.consumer_side

    def prefixes(self) -> list[str]:
        """The names' starts of every node's store of this run."""
        return [f"{cache_prefix(owner)}{self.token}-" for owner in {self.owner, *self.node_owners.values()}]

    def lookup(self, items: list[tuple[str, int]], ctx: BatchContext) -> None:
        """Before the source runs: the task's items, and the images of them this node holds (the
        source leaves those out; `__call__` puts them back in their places)."""
        ctx.wanted = items
        store = self._store(ctx.node)
        ctx.held = {} if store is None else {
            path: image for path, _ in items if (image := store.get(path)) is not None}

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        assert batch is not None and ctx.wanted is not None, "the graph calls lookup first"
        made = dict(zip(batch.paths, batch.data))
        store = self._store(ctx.node)
        if store is not None:
            for path, image in made.items():
                store.put(path, image)
        found = {**ctx.held, **made}
        kept = [(path, label) for path, label in ctx.wanted if path in found]  # files rejected upstream are out
        return Batch([found[path] for path, _ in kept], np.asarray([label for _, label in kept], dtype=np.int64),
                     [path for path, _ in kept])

    def close(self) -> None:
        """Close the stores of this run this process has open (their files are removed by name)."""
        for name in [name for name in _stores if name.startswith(tuple(self.prefixes()))]:
            os.close(_stores.pop(name).ledger)

    def _store(self, node: int) -> Store | None:
        if not self.budget_bytes:
            return None
        name = f"{cache_prefix(self.node_owners.get(node, self.owner))}{self.token}-n{node}"
        if name not in _stores:
            _stores[name] = Store(name, self.budget_bytes)
        return _stores[name]


class Store:
    """One node's store, as one process sees it."""

    def __init__(self, name: str, budget: int):
        self.name, self.budget = name, budget
        self.refused = budget + 1  # the smallest image refused for want of room: larger ones are not tried
        self.ledger = os.open(os.path.join(SHM_DIR, f"{name}-ledger"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW |
                              os.O_CLOEXEC, 0o600)

    def _path(self, key: str) -> str:
        return os.path.join(SHM_DIR, f"{self.name}-{hashlib.blake2b(key.encode(), digest_size=12).hexdigest()}")

    def get(self, key: str) -> np.ndarray | None:
        """The image stored under `key` (a read-only view of its mapping), or None."""
        try:
            fd = os.open(self._path(key), _READ)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER.size:
                return None
            buffer = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        magic, height, width, channels = HEADER.unpack_from(buffer)
        if magic != MAGIC or size != HEADER.size + height * width * channels:
            return None  # not one of ours: decode the file instead
        return np.frombuffer(buffer, np.uint8, height * width * channels, HEADER.size).reshape(height, width,
                                                                                                channels)

    def put(self, key: str, image: np.ndarray) -> bool:
        """Store `image` under `key` if the budget has room for it; whether it is stored now."""
        image = np.ascontiguousarray(image, dtype=np.uint8)
        if image.ndim == 2:
            image = image[:, :, None]
        pages = stored_bytes(image)
        if pages >= self.refused or not self._take(pages):
            self.refused = min(self.refused, pages)
            return False
        try:
            with written_whole(self._path(key), 0o600, replace=False) as file:  # published whole, or not at all
                file.write(HEADER.pack(MAGIC, *image.shape))
                file.write(image.data)
            return True
        except OSError:  # another worker stored it first (FileExistsError), or /dev/shm is full
            self._take(-pages)
            return False

    def _take(self, pages: int) -> bool:
        """Count `pages` bytes more (fewer, if negative) in the ledger, if they fit the budget."""
        fcntl.flock(self.ledger, fcntl.LOCK_EX)
        try:
            used = self.used()
            if used + pages > self.budget:
                return False
            os.pwrite(self.ledger, (used + pages).to_bytes(8, "little"), 0)
            return True
        finally:
            fcntl.flock(self.ledger, fcntl.LOCK_UN)

    def used(self) -> int:
        """Bytes the ledger counts."""
        return int.from_bytes(os.pread(self.ledger, 8, 0).ljust(8, b"\0"), "little")


_stores: dict[str, Store] = {}  # in each process: the stores it has opened
