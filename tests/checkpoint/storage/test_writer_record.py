"""A save's writer record (``host pid`` in its temporary or aside folder) appears whole or not at all.

A load removes a killed save's folder only when the record names a writer that is gone; a folder whose record
is empty is kept forever. The record used to be created empty and then written, so a SIGKILL in between
(which ``test_abandoned_folders`` aims at: it kills as soon as the record exists) left such a folder. Here a
tracer looks at the record after every line Python runs while it is written, so any moment it is seen empty
fails the test, on every run, without a process to kill.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from fabric.checkpoint.storage import disk


def test_the_record_is_never_seen_empty_while_it_is_written(tmp_path: Path) -> None:
    folder = tmp_path / f"{disk.TEMP_FOLDER_PREFIX}ckpt.aaaaaaaaaaaa"
    record = folder / disk.WRITER_FILE
    seen: list[str] = []

    def look(frame, event, arg):
        if event == "line" and record.exists():
            seen.append(record.read_text())
        return look

    sys.settrace(look)
    try:
        disk.mark_writer(folder)
    finally:
        sys.settrace(None)
    assert "" not in seen, "the record existed empty: a kill at that moment leaves a folder no clean-up removes"
    assert record.read_text() == f"{socket.gethostname()} {os.getpid()}\n"
    assert sorted(p.name for p in folder.iterdir()) == [disk.WRITER_FILE]
