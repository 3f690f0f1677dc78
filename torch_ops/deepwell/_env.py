"""Every DEEPWELL_* environment variable, read here and nowhere else (listed in README.md)."""

from __future__ import annotations

import os

#: Path of the deepwell shared library to load instead of the one installed in the package
#: (used on the GPU machine, where the library is built elsewhere and carried over).
LIBRARY: str | None = os.environ.get("DEEPWELL_LIBRARY") or None
