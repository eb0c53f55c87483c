"""Files a run writes as it goes (pipeline/runtime/files.py): whole or not at all."""
import os

import pytest

from pipeline.runtime.files import write_whole, written_whole


def test_a_write_that_fails_leaves_the_previous_file_and_nothing_beside_it(tmp_path):
    """A writer that fails (or is killed) midway leaves the file as it was. Writing in place, or leaving
    the partial file behind, fails."""
    path = tmp_path / "state" / "run.json"
    write_whole(path, "before")
    with pytest.raises(RuntimeError, match="midway"):
        with written_whole(path) as file:
            file.write(b"half of the")
            raise RuntimeError("midway")
    assert path.read_text() == "before" and os.listdir(path.parent) == ["run.json"]
    write_whole(path, "after")
    assert path.read_text() == "after" and os.listdir(path.parent) == ["run.json"]


def test_without_replace_the_first_writer_wins_and_nothing_is_left_beside_it(tmp_path):
    """A store that processes share (the decoded-image cache) keeps its first entry whole: a second
    writer of the same path gets FileExistsError. Replacing, or leaving the loser's partial file, fails."""
    path = tmp_path / "entry"
    with written_whole(path, 0o600, replace=False) as file:
        file.write(b"first")
    with pytest.raises(FileExistsError):
        with written_whole(path, 0o600, replace=False) as file:
            file.write(b"second")
    assert path.read_bytes() == b"first" and os.listdir(tmp_path) == ["entry"]
    assert path.stat().st_mode & 0o777 == 0o600
