"""Files a run writes as it goes, whole or not at all."""
from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

# A new file of the writer's own: one already there (planted, or a link) is an error, not overwritten.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@contextmanager
def written_whole(path: str | Path, mode: int = 0o644, *, replace: bool = True) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s content into: it becomes `path` only once the block ends without
    an error, so a process killed while writing leaves the previous file (or none), never half of one.
    The partial file's name is unguessable (nobody can plant a file or link there first) and it is
    removed whatever happens. With `replace=False` the first writer wins: the file is published by a
    link, and a `path` already there raises FileExistsError (entries of a store that processes share)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial-{secrets.token_hex(8)}")
    created = os.open(partial, _CREATE, mode)  # before the try: a file there that is not ours stays
    try:
        with os.fdopen(created, "wb") as file:
            yield file
        (os.replace if replace else os.link)(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_whole(path: str | Path, text: str) -> None:
    """`text` into `path`, whole or not at all."""
    with written_whole(path) as file:
        file.write(text.encode())
