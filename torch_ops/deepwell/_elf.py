"""A shared library is checked before dlopen: a truncated file (an interrupted copy, a full disk)
maps pages past its end, and the first touch of one kills the process with SIGBUS instead of
raising. The ELF headers say how long the file must be (System V gABI, "ELF Header" and "Program
Header"): every loadable segment and the section header table must lie inside it."""

from __future__ import annotations

import os
import struct

_PT_LOAD = 1


def check_shared_library(path: str, who: str) -> None:
    """Raises RuntimeError(f"{who}: ...") unless `path` is a complete 64-bit little-endian ELF file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(64)
            if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
                raise RuntimeError(f"{who}: {path!r} is not a 64-bit little-endian ELF shared library")
            phoff, shoff = struct.unpack_from("<QQ", header, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", header, 0x36)
            ends = [phoff + phentsize * phnum, shoff + shentsize * shnum]
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except OSError as e:
        raise RuntimeError(f"{who}: cannot read {path!r}: {e}") from None
    if len(table) == phentsize * phnum and phentsize >= 56:
        for i in range(phnum):
            kind, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
            if kind == _PT_LOAD:
                ends.append(offset + filesz)
    if max(ends) > size:
        raise RuntimeError(
            f"{who}: {path!r} is truncated ({size} bytes; its ELF headers need {max(ends)}): "
            "copy or rebuild it"
        )
