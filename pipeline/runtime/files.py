"""Files a run writes as it goes, whole or not at all."""
from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """`text` into `path`, whole or not at all: a process killed while writing leaves the previous file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
