"""docs/OPS.md lists exactly the ops deepwell registers: every `torch.ops.deepwell` op has a row in
the tables under its "Ops" heading, and every row there names a registered op, so the reference
cannot fall behind the registry or keep an op that was removed.

A row's op is the name before the first "(" of its first cell's backticked signature; the registry
is torch's dispatcher, as tests/ops/test_registry.py reads it."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import deepwell  # noqa: F401  (loads the library, which registers the ops)

OPS_MD = Path(__file__).resolve().parents[2] / "docs" / "OPS.md"
ROW = re.compile(r"^\|\s*`([A-Za-z_][A-Za-z0-9_]*)\(")
NAMED = re.compile(r"torch\.ops\.deepwell\.([A-Za-z_][A-Za-z0-9_]*)")


def registered_ops() -> set[str]:
    names = torch._C._dispatch_get_all_op_names()
    return {n.split("::", 1)[1] for n in names if n.startswith("deepwell::")}


def ops_section(text: str) -> list[str]:
    """The lines under the `## Ops` heading, up to the next level-2 heading."""
    lines = text.splitlines()
    start = lines.index("## Ops")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def documented_rows(text: str) -> list[str]:
    return [m.group(1) for line in ops_section(text) if (m := ROW.match(line))]


def test_ops_md_has_an_ops_section():
    assert "## Ops" in OPS_MD.read_text().splitlines(), "docs/OPS.md: no '## Ops' heading"


def test_every_registered_op_is_documented():
    missing = sorted(registered_ops() - set(documented_rows(OPS_MD.read_text())))
    assert not missing, f"docs/OPS.md has no row for the registered ops {missing}"


def test_every_documented_op_is_registered():
    text = OPS_MD.read_text()
    unknown = sorted((set(documented_rows(text)) | set(NAMED.findall(text))) - registered_ops())
    assert not unknown, f"docs/OPS.md names ops torch.ops.deepwell does not register: {unknown}"


def test_each_op_has_one_row():
    rows = documented_rows(OPS_MD.read_text())
    twice = sorted({n for n in rows if rows.count(n) > 1})
    assert not twice, f"docs/OPS.md has more than one row for {twice}"


def test_the_checks_can_fail():
    """The parser finds rows and the comparison sees a missing and an unknown op."""
    sample = "## Ops\n\n| op | what |\n|---|---|\n| `swiglu(gate_up)` | x |\n| `no_such_op(x)` | y |\n\n## Next\n| `mxfp8_linear(x)` | z |\n"
    assert documented_rows(sample) == ["swiglu", "no_such_op"]
    assert "no_such_op" not in registered_ops()
    assert "mxfp8_linear" in registered_ops() - set(documented_rows(sample))
