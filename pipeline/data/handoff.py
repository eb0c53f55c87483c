"""Worker-to-driver hand-off of finished batches on one node.

A batch task on a worker of the driver's node leaves its arrays in shared
memory and returns only their names; the driver maps them. This replaces
pickling megabytes through Dask's TCP connection (the larger cost at 224 px)
with one write by the worker and a read of the mapping by the driver.
"""
from __future__ import annotations

import glob
import mmap
import os
from dataclasses import dataclass

import numpy as np

SHM_DIR = "/dev/shm"
HANDOFF_PREFIX = "ensemble-out"  # then the taking process's pid


@dataclass(frozen=True)
class SharedArray:
    """A uint8 array a worker left at /dev/shm/<segment>."""

    segment: str
    shape: tuple[int, ...]

    @staticmethod
    def write(segment: str, array: np.ndarray) -> SharedArray:
        path = os.path.join(SHM_DIR, segment)
        # Written under a temporary name and renamed: a task re-run after its
        # worker died mid-write replaces the half-written file atomically.
        partial = f"{path}.partial-{os.getpid()}"
        with open(partial, "wb") as file:
            file.write(np.ascontiguousarray(array, dtype=np.uint8).data)
        os.replace(partial, path)
        return SharedArray(segment, tuple(array.shape))

    def take(self) -> np.ndarray:
        """Map the array read-only and unlink its file: the mapping stays valid
        until the last view of it is gone, and nothing is left behind."""
        path = os.path.join(SHM_DIR, self.segment)
        with open(path, "rb") as file:
            size = int(np.prod(self.shape))
            buffer = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) if size else b""
        os.unlink(path)
        return np.frombuffer(buffer, dtype=np.uint8).reshape(self.shape)


def remove_all(prefix: str) -> None:
    """Delete what tasks of a run left behind (a stopped run, a killed worker)."""
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
        except FileNotFoundError:  # its task's own clean-up got there first
            pass
