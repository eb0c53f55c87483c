"""Worker-to-driver hand-off of finished batches on one node.

A batch task on a worker of the driver's node leaves its arrays in shared
memory and returns only their names; the driver maps them. This replaces
pickling megabytes through Dask's TCP connection (the larger cost at 224 px)
with one write by the worker and a read of the mapping by the driver.
"""
from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass

import numpy as np

from pipeline.runtime.files import written_whole
from pipeline.runtime.lifetime import SHM_DIR

HANDOFF_PREFIX = "ensemble-out"  # then the taking process's pid (stale files name their owner), then random parts


@dataclass(frozen=True)
class SharedArray:
    """A uint8 array a worker left at /dev/shm/<segment>."""

    segment: str
    shape: tuple[int, ...]

    @staticmethod
    def write(segment: str, array: np.ndarray) -> SharedArray:
        """Leave `array` at /dev/shm/<segment>-<random>, readable by this user only."""
        segment = f"{segment}-{secrets.token_hex(8)}"  # unguessable: nobody can plant a file or link there first
        # Whole or not at all: a task re-run after its worker died mid-write never hands over half a file.
        with written_whole(os.path.join(SHM_DIR, segment), mode=0o600) as file:
            file.write(np.ascontiguousarray(array, dtype=np.uint8).data)
        return SharedArray(segment, tuple(array.shape))

    def take(self) -> np.ndarray:
        """Map the array read-only and unlink its file: the mapping stays valid
        until the last view of it is gone, and nothing is left behind."""
        path = os.path.join(SHM_DIR, self.segment)
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as file:
            size = int(np.prod(self.shape))
            buffer = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) if size else b""
        os.unlink(path)
        return np.frombuffer(buffer, dtype=np.uint8).reshape(self.shape)

