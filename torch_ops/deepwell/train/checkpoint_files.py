"""Reading a checkpoint directory as untrusted input: a checkpoint can be edited by hand, copied
from elsewhere, or damaged, and its manifest's SHA-256 proves nothing against an editor who
recomputes it. So what a manifest names is confined and every read is bounded:

- A file name is a relative POSIX path of plain components (`check_name`): no absolute path, no
  "", "." or ".." component, no NUL or backslash.
- `open_regular` walks the components with openat (`dir_fd`) and O_NOFOLLOW, so no component
  below the checkpoint directory may be a symbolic link (deepwell writes none, and a link could
  point anywhere: /dev/zero, a file outside the checkpoint). O_NONBLOCK keeps the open of a FIFO
  from waiting for a writer, and the fstat after it refuses anything but a regular file, so no
  device, FIFO or socket is ever read.
- Sizes are compared with the manifest's before any byte is read, and reads stop at the size
  (`read_bounded`, `sha256`): a file that grows while it is read cannot make a read unbounded.
- `require` checks a manifest's keys and their JSON types once, so an edited manifest is a
  CheckpointError naming the key rather than a KeyError or TypeError deep in a loader.

The checkpoint directory itself (the path the caller names) may be a symbolic link: the user chose it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

#: The largest manifest.json read. Its size grows with the training history (one record of about
#: 250 bytes per step, Trainer.history), so 256 MiB is about a million steps; a bigger one is not a
#: manifest deepwell wrote, and reading it whole would only exhaust memory.
MAX_MANIFEST_BYTES = 256 << 20
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: missing, partial, corrupted or edited."""


def check_name(name: object, where: str) -> str:
    """`name` when it is a relative path of plain components inside a checkpoint; else a CheckpointError."""
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise CheckpointError(
            f"{where}: the manifest names file {name!r}, which is not a path inside the checkpoint "
            "(absolute paths and '', '.' or '..' components are refused: the manifest was edited)"
        )
    return name


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


@contextmanager
def open_regular(root: Path, name: str, where: str) -> Iterator[tuple[BinaryIO, int]]:
    """(file, size) of the regular file `name` (a `check_name` path) under directory `root`,
    opened without following a symbolic link anywhere below `root`; a CheckpointError naming it
    when it is missing, a link, or not a regular file."""
    path = root / check_name(name, where)
    *dirs, leaf = name.split("/")
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    except OSError as e:
        raise CheckpointError(f"{where}: {root} is not a readable directory ({e.strerror})") from None
    try:
        for part in dirs:
            sub = os.open(part, flags | os.O_DIRECTORY, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = sub
        fd = os.open(leaf, flags | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: {path} is missing") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CheckpointError(
                f"{where}: {path} is, or lies under, a symbolic link or a non-directory; deepwell writes neither "
                "and a link could point outside the checkpoint, so it is refused"
            ) from None
        raise CheckpointError(f"{where}: {path} cannot be opened ({e.strerror})") from None
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{where}: {path} is {_kind(st.st_mode)}, not a regular file; a checkpoint holds regular files only")
    with os.fdopen(fd, "rb") as f:
        yield f, st.st_size


def read_bounded(root: Path, name: str, limit: int, where: str, what: str) -> bytes:
    """The whole of regular file `name` under `root`, refused beyond `limit` bytes (`what` names
    the file's role and its bound in the error)."""
    with open_regular(root, name, where) as (f, size):
        data = f.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise CheckpointError(f"{where}: {root / name} has {max(size, len(data))} bytes or more, more than the {limit} {what} can have")
        return data


def sha256(f: BinaryIO, size: int) -> str:
    """The SHA-256 of the first `size` bytes of `f` (fewer if it ends first: then another digest)."""
    h, left = hashlib.sha256(), size
    while left > 0:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()


def fd_path(f: BinaryIO, path: Path) -> str:
    """A path that opens the very file `f` holds open (Linux /proc/self/fd), so a reader that takes a
    path (safetensors) reads the checked file even if the name is swapped after the check; `path`
    where /proc is absent."""
    proc = f"/proc/self/fd/{f.fileno()}"
    return proc if os.path.exists(proc) else str(path)


def _type_names(want) -> str:
    kinds = want if isinstance(want, tuple) else (want,)
    return " or ".join("null" if k is type(None) else {dict: "object", list: "array", str: "string", int: "integer"}.get(k, k.__name__) for k in kinds)


def require(obj: dict, spec: dict, where: str, prefix: str = "") -> None:
    """Raises a CheckpointError naming the first key of `spec` that `obj` (a manifest or part of
    one) lacks or holds with another JSON type. `spec`: key -> a type, a tuple of types, or a
    nested spec (the key must hold an object with those keys). JSON's true and false are not
    integers here."""
    for key, want in spec.items():
        name = f"{prefix}{key}"
        if key not in obj:
            raise CheckpointError(f"{where}: the manifest has no {name!r} (it was edited, or deepwell did not write it)")
        value = obj[key]
        kinds = dict if isinstance(want, dict) else want
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,))):
            raise CheckpointError(
                f"{where}: the manifest's {name!r} is {type(value).__name__} {value!r:.60}, expected {_type_names(kinds)} "
                "(it was edited, or deepwell did not write it)"
            )
        if isinstance(want, dict):
            require(value, want, where, f"{name}.")
