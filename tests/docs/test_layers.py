"""The package's layers (docs/DESIGN.md "Layout"): each package of torch_ops/deepwell imports only
from the layers below it, no module imports form a cycle, and no deepwell import hides inside a
function (the usual way to dodge a cycle), except the few listed here with why."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "torch_ops" / "deepwell"

#: Bottom to top. A module may import its own layer and the ones listed before it.
LAYERS = [
    {"_native", "_env", "_elf"},
    {"core"},
    {"ops"},
    {"kernels"},
    {"nn", "models"},
    {"distributed"},
    {"plan"},
    {"compiler"},
    {"train"},
    {"artifact"},
    {"api", "parity", "cli", "__main__", "__init__"},
]

#: (importing module, imported module): why the import waits for the call.
DEFERRED = {
    ("deepwell.train.distributed", "deepwell.train.clip"):
        "clip.py imports torch.distributed.tensor, needed only with several processes",
    ("deepwell.train.sharded", "deepwell.train.dcp_reader"):
        "dcp_reader.py imports torch.distributed.checkpoint, needed only to resume a sharded checkpoint",
}


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, names in enumerate(LAYERS) if top in names)


def _imports(path: Path, text: str | None = None):
    """(imported deepwell module, line, inside a function) of every deepwell import in `path` (its
    source `text` when given)."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text() if text is None else text)
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    # `if TYPE_CHECKING:` imports name types for annotations and never run.
    typing_only = {id(n) for b in ast.walk(tree) if isinstance(b, ast.If) and getattr(b.test, "id", "") == "TYPE_CHECKING"
                   for n in ast.walk(b)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "deepwell":
                target = node.module
            else:
                continue
            names = [f"{target}.{a.name}" for a in node.names]
            found = [n for n in names if (PKG.parent / (n.replace(".", "/") + ".py")).exists()
                     or (PKG.parent / n.replace(".", "/")).is_dir()]
            for t in found or [target]:
                yield t, node.lineno, id(node) in in_function
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "deepwell":
                    yield a.name, node.lineno, id(node) in in_function


MODULES = {_module(p): p for p in sorted(PKG.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    up = [f"{target} (line {line})" for target, line, _ in _imports(MODULES[module])
          if target != "deepwell" and _layer(target) > _layer(module)]
    assert not up, f"{module} (layer {_layer(module)}) imports from a higher layer: {up}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_hides_in_a_function(module):
    hidden = [f"{t} (line {line})" for t, line, inner in _imports(MODULES[module])
              if inner and (module, t) not in DEFERRED]
    assert not hidden, f"{module} imports deepwell modules inside functions: {hidden}"


def test_no_module_cycle():
    graph = {m: {t for t, _, inner in _imports(p) if not inner and t in MODULES and t != m} for m, p in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checks_can_fail():
    """The parser sees what the checks need: an upward import, a hidden one, and a relative import
    resolved against the module's package."""
    probe = PKG / "ops" / "_layers_probe.py"
    found = list(_imports(probe, "from ..compiler import backend\n\ndef f():\n    from . import _checks\n"))
    assert ("deepwell.compiler.backend", 1, False) in found and ("deepwell.ops._checks", 4, True) in found
    assert _layer("deepwell.compiler.backend") > _layer("deepwell.ops._layers_probe")
