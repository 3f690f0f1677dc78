"""The training log: one JSON object per line (metrics.jsonl), appended and flushed as it goes, so a
crashed run keeps what it logged and a resumed run continues the same file."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _jsonable(v):
    # JSON has no NaN/Infinity: a non-finite loss or grad norm is logged as the string "nan"/"inf".
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class JsonlLog:
    """Appends records to `path` (None: keeps them in memory only)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path is not None else None
        self.records: list[dict] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        record = {k: _jsonable(v) for k, v in record.items()}
        self.records.append(record)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def read(path: str | os.PathLike) -> list[dict]:
    """Every record of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
