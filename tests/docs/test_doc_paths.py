"""Every repository path named in a comment, docstring or document exists.

Scans the source and documentation files git tracks (and new ones it does not ignore) for tokens
that look like paths in this repository and checks that each resolves, so a citation cannot point
at a file that moved or at a document that is not shipped. A token is a path when it contains a '/'
and either starts with a top-level directory of the repository (`rust/`, `cuda/`, `tests/`, ...),
starts with `./`, `../` or `/`, or ends in a file extension; a bare name ending in .md is a path
too. It resolves when it names a tracked file or directory relative to the repository root, to the
citing file's directory or one of its parents, or (bare `.md` names only) to docs/; a path that
does not start with a top-level directory may also be the tail of a tracked path
(`gemm/epilogue.rs`); `*` globs must match something. Text inside URLs, and paths built from
placeholders (`<root>/...`, `{dir}/...`, `$OUT/...`, `~/...`), are skipped. Paths outside the
repository that the code names on purpose are in ALLOWED, each with its reason.

A second check reads citations of a section, `docs/NUMERICS.md "MXFP8"`, and asserts that the
document has a heading starting with that text.

Needs no GPU and no deepwell build: it reads files only.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]

SCANNED_SUFFIXES = (".rs", ".py", ".cuh", ".md", ".toml", ".sh", ".yml", ".yaml")
SCANNED_EXTRA = (".ci/run",)  # a shell script without an extension
TOP_DIRS = ("rust", "cuda", "torch_ops", "tests", "benchmarks", "docs", "examples", ".ci")
EXTENSION = re.compile(r"\.(?:rs|py|pyi|cuh|cu|h|md|toml|sh|ya?ml|json|log|txt|lock|so(?:\.\d+)*)$")
SKIPPED_DIRS = {".git", "target", "build", "dist", "__pycache__", ".venv", ".whl", ".device"}

# Paths outside the repository that code or docs name on purpose (fnmatch patterns) -> why.
ALLOWED = {
    "torch/csrc/*": "PyTorch's own headers (the stable C ABI that rust/ops binds), cited as public sources",
    "nvidia/*/lib/libnvrtc.so.*": "NVRTC in the nvidia wheels torch's CUDA build installs in site-packages",
    "target/release/libdeepwell.so": "cargo's build output (README's development instructions)",
    ".device/libdeepwell.so": "an ignored path where benchmarks/device_run.sh expects a carried build",
    "deepwell/_deepwell.so": "the library's place in the wheel and the installed package: setup.py builds it, git ignores it",
    "/proc/*": "Linux procfs, read at run time (memory statistics) or used as an unwritable directory",
    "/usr/bin/env": "shebang line",
    "/dev/zero": "Linux's endless device: what the checkpoint trust tests point a manifest at, and a reader must refuse",
    "../evil": "a name outside the checkpoint that the checkpoint trust tests write into a manifest",
    "*parity.md": "the table python -m deepwell.parity and the main job write into their output directory at run time",
}

URL = re.compile(r"[A-Za-z][\w+.-]*://\S+")
TOKEN = re.compile(r"[\w.*~/-]+")
PLACEHOLDER_BEFORE = set("<>{}$%)]~")
PLACEHOLDER_AFTER = set("<>{}")
SECTION_CITE = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md) \"([^\"\n]+)\"")


def _listed_files() -> list[str]:
    """Tracked and untracked-but-not-ignored files (git), or a walk of the tree without git."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, text=True, check=True, timeout=30,
        ).stdout
        files = sorted({f for f in out.splitlines() if f})
    except (OSError, subprocess.SubprocessError):
        files = []
        for p in ROOT.rglob("*"):
            rel = p.relative_to(ROOT)
            if any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
                continue
            if p.is_file():
                files.append(rel.as_posix())
    return [f for f in files if (ROOT / f).is_file()]


FILES = _listed_files()
FILE_SET = set(FILES)
DIR_SET = {str(p) for f in FILES for p in PurePosixPath(f).parents if str(p) != "."}
EXISTING = FILE_SET | DIR_SET


def _scanned() -> list[str]:
    return [f for f in FILES if f.endswith(SCANNED_SUFFIXES) or f in SCANNED_EXTRA]


def _exists(rel: str) -> bool:
    rel = rel.rstrip("/")
    if not rel or rel == ".":
        return True
    if "*" in rel:
        return any(fnmatch.fnmatchcase(p, rel) for p in EXISTING)
    return rel in EXISTING


def _norm(base: PurePosixPath, token: str) -> str | None:
    """`base/token` with `.` and `..` folded; None when it leaves the repository."""
    parts: list[str] = []
    for part in (base / token).parts:
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts)


def _resolves(token: str, citing: str) -> bool:
    if token.startswith("/"):
        return False  # an absolute path is never a repository path
    bare = "/" not in token.rstrip("/")
    bases = [*PurePosixPath(citing).parents]  # the citing file's directory, its parents, the root
    if bare:
        bases.append(PurePosixPath("docs"))
    for base in bases:
        rel = _norm(base, token)
        if rel is not None and _exists(rel):
            return True
    first = token.split("/", 1)[0]
    if not bare and first not in TOP_DIRS and first not in (".", ".."):
        tail = token.rstrip("/")  # a path relative to some package directory: a tracked path's tail
        return any(fnmatch.fnmatchcase(p, tail) or fnmatch.fnmatchcase(p, "*/" + tail) for p in EXISTING)
    return False


def _is_path(token: str) -> bool:
    if "/" not in token:
        return token.endswith(".md") and len(token) > 3
    if not re.search(r"[A-Za-z]", token):
        return False  # "//", "K/32"
    if token.startswith("/"):
        return token.count("/") >= 2  # "/proc/self/status", not "/s" of "GB/s"
    return (
        token.startswith(("./", "../"))
        or token.split("/", 1)[0] in TOP_DIRS
        or EXTENSION.search(token) is not None
    )


def path_tokens(text: str):
    """(line number, token) for every path-like token of `text`."""
    for lineno, line in enumerate(text.splitlines(), 1):
        line = URL.sub(" ", line)
        for m in TOKEN.finditer(line):
            token = m.group(0).rstrip(".,:;-")
            before = line[m.start() - 1] if m.start() else ""
            after = line[m.end() : m.end() + 1]
            if not token or before in PLACEHOLDER_BEFORE or after in PLACEHOLDER_AFTER or token[0] == "~":
                continue
            if _is_path(token):
                yield lineno, token


def _allowed(token: str) -> bool:
    return any(fnmatch.fnmatchcase(token, pattern) for pattern in ALLOWED)


def test_cited_paths_exist():
    scanned = _scanned()
    assert "README.md" in scanned and len(scanned) > 50, f"found only {len(scanned)} files under {ROOT}"
    missing = []
    for f in scanned:
        text = (ROOT / f).read_text(encoding="utf-8", errors="replace")
        for lineno, token in path_tokens(text):
            if not _allowed(token) and not _resolves(token, f):
                missing.append(f"{f}:{lineno}: {token}")
    assert not missing, "paths that name nothing in the repository:\n" + "\n".join(missing)


def _headings(doc: str) -> list[str]:
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [line.lstrip("#").strip().replace("`", "") for line in text.splitlines() if line.startswith("#")]


def test_cited_sections_exist():
    """`docs/NUMERICS.md "MXFP8"`: the cited document has a heading that starts with "MXFP8"."""
    bad = []
    for f in _scanned():
        text = (ROOT / f).read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in SECTION_CITE.finditer(line):
                doc, section = m.groups()
                bases = [*PurePosixPath(f).parents, PurePosixPath("docs")]
                target = next((r for b in bases if (r := _norm(b, doc)) in FILE_SET), None)
                if target is None:
                    continue  # a missing document is test_cited_paths_exist's failure
                if not any(h.startswith(section) for h in _headings(target)):
                    bad.append(f'{f}:{lineno}: {target} has no section "{section}"')
    assert not bad, "citations of sections that do not exist:\n" + "\n".join(bad)


def test_allowlist_entries_are_used():
    """Every ALLOWED entry still matches something, so the list stays short."""
    used = set()
    for f in _scanned():
        if f == "tests/docs/test_doc_paths.py":
            continue  # the list itself
        text = (ROOT / f).read_text(encoding="utf-8", errors="replace")
        for _, token in path_tokens(text):
            used.update(p for p in ALLOWED if fnmatch.fnmatchcase(token, p))
    assert used == set(ALLOWED), f"unused allowlist entries: {sorted(set(ALLOWED) - used)}"
