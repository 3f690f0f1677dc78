"""One writer per checkpoint directory. A writer deletes the `.tmp-*` staging directories it finds
(train/checkpoint.py `begin`: those of writers that died) and prunes old checkpoints, so a second
Trainer writing the same directory would delete the first one's checkpoint in progress. A Trainer
holds an exclusive flock(2) on `<checkpoint_dir>/.lock` while it runs (under several processes,
rank 0 alone: it is the one that stages, commits and prunes); a second one gets a CheckpointError
naming the directory and the holder.

flock belongs to the open file, so the kernel drops it when its holder exits, however it dies: a
lock file left behind by a dead process never blocks (the file stays; only its lock matters).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import warnings
from pathlib import Path

from .checkpoint_files import CheckpointError

LOCK = ".lock"
_HOLDER_BYTES = 256


class DirectoryLock:
    """The exclusive lock on a checkpoint directory; `acquire` raises CheckpointError when another
    process (or another open of it in this one) holds it."""

    def __init__(self, directory: str | os.PathLike, who: str = "deepwell.Trainer"):
        self.directory, self.who = Path(directory), who
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "DirectoryLock":
        if self._fd is not None:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / LOCK
        # O_NOFOLLOW: the holder's note is written into this file, never through a link elsewhere.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError(f"{self.who}: {path} is not a regular file; remove it to use {self.directory} as checkpoint_dir")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise CheckpointError(
                f"{self.who}: checkpoint_dir {self.directory} is in use by another Trainer ({holder}): two runs writing one "
                "directory delete each other's checkpoints in progress. Give this run its own checkpoint_dir, or wait for the other to finish"
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
                raise
            # A file system without locks (some network mounts): run unguarded rather than not at all.
            warnings.warn(f"{self.who}: {self.directory} cannot be locked ({e.strerror}); make sure no other run writes it", stacklevel=3)
            return self
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor of the open file drops its flock
