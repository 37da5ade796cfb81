"""The local folders shard caches keep their files in: one per process, removed when it ends.

Each reading process (a rank, a loader worker) keeps its cache in a folder of its own, so
that ranks on one machine each hold the budget they account for and one never deletes a
file another is reading. A folder is named after its host and process id,
``reader-<host>-<pid>-<random>``: it is removed when its cache is closed or garbage
collected and when the process exits, and a process killed without a chance to clean up
(SIGKILL, a lost node) leaves one behind that the next reader of the same corpus on the
same host removes, once no process of that id runs there.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

PREFIX = "reader-"


def _host() -> str:
    """This host's name as it may stand in a folder name."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


def new_reader_folder(parent: Path) -> Path:
    """A new, empty folder under ``parent`` (which must exist: a removed one stays removed)
    for this process's cache (see the module docstring)."""
    return Path(tempfile.mkdtemp(dir=parent, prefix=f"{PREFIX}{_host()}-{os.getpid()}-"))


def remove_folder(folder: Path, owner_pid: int) -> None:
    """Remove ``folder`` if this process is ``owner_pid``: a forked child inherits the
    parent's finalizers, and must not remove the folder its parent still reads from."""
    if os.getpid() != owner_pid:
        return
    for _ in range(3):  # a loader worker may be writing a file into it meanwhile: once gone, it stays gone
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            return


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host: a zombie (killed, not yet reaped) does not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no such process, or no /proc here
        state = ""
    if state == "Z":
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_abandoned(parent: Path) -> list[Path]:
    """Remove the folders under ``parent`` left by processes of this host that no longer
    run (a folder of another host is left to that host); the folders removed."""
    pattern = re.compile(rf"{re.escape(PREFIX + _host())}-(\d+)-")
    removed = []
    for folder in parent.glob(f"{PREFIX}*"):
        match = pattern.match(folder.name)
        if match and folder.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
