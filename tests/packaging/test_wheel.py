"""The wheel: `pip wheel .` gives one py3-none-manylinux wheel that installs and runs without a Rust
toolchain.

The wheel is the one $DEEPWELL_WHEEL names, else one this module builds with `pip wheel . --no-deps`
(from CI's warm cargo cache: the same cargo command as `pip install .`, so nothing recompiles).
Checked on the archive: its name and WHEEL tag (py3-none, and manylinux_2_N with N the newest
GLIBC_2.N version the library needs, as `readelf` reads it), its files (every module of
torch_ops/deepwell and one `_deepwell.so`), its metadata and the `torch_dynamo_backends` entry
point; the library needs nothing outside the manylinux set (no torch or CUDA symbol, which deepwell
finds with dlopen at run time) and carries no debug sections.

Then it is installed into a fresh virtualenv, with no cargo or rustc on PATH and without
DEEPWELL_LIBRARY or PYTHONPATH, from outside the source tree. torch and the test dependencies come
from the Python running this test: `--system-site-packages` reaches only the base interpreter's, so
a .pth file adds this one's site-packages after the virtualenv's own, where the wheel's deepwell
comes first. From there: `import deepwell` (its modules and library from the virtualenv), the
backend found by name through the entry point, the main job at its smallest
(`--quick --steps 4 --parity-steps 0`: plan, training, resume and export, under a minute), and
a few files of the fast tier (`FAST_SUBSET`: every op registered by the packaged library, errors
unwinding through its frames, the MXFP8 ops against the reference, the backend's rewrite: under a
minute). What a wheel can break (files, the library, its loading, the entry point) these reach;
the rest of the fast tier would double CI's time for nothing more, and CI runs it against
`pip install .`.

`slow`: about a minute and a half on 2 cores, 40 s more when it builds the wheel."""

from __future__ import annotations

import configparser
import email.parser
import os
import platform
import re
import shutil
import site
import subprocess
import sys
import zipfile
from importlib.util import find_spec
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "torch_ops" / "deepwell"
WHEEL_NAME = re.compile(r"deepwell-(?P<version>[^-]+)-py3-none-manylinux_2_(?P<glibc>\d+)_(?P<arch>\w+)\.whl")

#: System libraries the manylinux policies allow (auditwheel's list holds more, libstdc++ and X11
#: among them, which deepwell has no use for); ld-linux is the dynamic loader.
MANYLINUX_LIBS = {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "libpthread.so.0", "libdl.so.2", "librt.so.1",
                  "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}
#: Undefined symbols without a version that every gcc-linked shared library has (weak, for
#: transactional memory and profiling); everything else must come versioned from glibc or libgcc.
WEAK_UNVERSIONED = {"_ITM_deregisterTMCloneTable", "_ITM_registerTMCloneTable", "__gmon_start__"}

# The fast-tier files run against the installed wheel (see the docstring).
FAST_SUBSET = ["tests/ops/test_registry.py", "tests/ops/test_errors.py", "tests/ops/test_mxfp8.py",
               "tests/compiler/test_backend.py::test_the_rewritten_graph_calls_deepwell_ops"]


def _run(cmd, timeout=600, **kw):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, (f"{' '.join(map(str, cmd))} exited {done.returncode}:\n"
                                  f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if os.environ.get("DEEPWELL_WHEEL"):
        return Path(os.environ["DEEPWELL_WHEEL"]).resolve()
    if shutil.which("cargo") is None:
        pytest.skip("building the wheel needs cargo; or point DEEPWELL_WHEEL at a built one")
    out = tmp_path_factory.mktemp("dist")
    # Offline when this Python has the build requirements; else pip fetches them (build isolation).
    has_requirements = find_spec("setuptools_rust") and find_spec("setuptools.command.bdist_wheel")
    offline = ["--no-build-isolation"] if has_requirements else []
    _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", *offline, "-w", str(out)],
         timeout=1200)
    (built,) = out.glob("deepwell-*.whl")
    return built


@pytest.fixture(scope="module")
def library(wheel, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("library") / "_deepwell.so"
    with zipfile.ZipFile(wheel) as z:
        out.write_bytes(z.read("deepwell/_deepwell.so"))
    return out


def _readelf(*args) -> str:
    if shutil.which("readelf") is None:
        pytest.skip("needs readelf (binutils)")
    return _run(["readelf", "-W", *args])


def test_the_name_and_tag_say_py3_none_manylinux(wheel):
    m = WHEEL_NAME.fullmatch(wheel.name)
    assert m, f"{wheel.name}: not deepwell-<version>-py3-none-manylinux_2_N_<arch>.whl"
    assert m["arch"] == platform.machine()
    with zipfile.ZipFile(wheel) as z:
        meta = email.parser.Parser().parsestr(z.read(f"deepwell-{m['version']}.dist-info/WHEEL").decode())
    assert meta.get_all("Tag") == [wheel.name[len(f"deepwell-{m['version']}-"):-len(".whl")]]
    assert meta["Root-Is-Purelib"] == "false"  # a binary inside: installed to platlib


def test_the_manylinux_tag_is_the_newest_glibc_the_library_needs(wheel, library):
    needed = {int(n) for n in re.findall(r"Name: GLIBC_2\.(\d+)", _readelf("--version-info", str(library)))}
    assert needed, "the library needs no versioned glibc symbol: is it a glibc build?"
    assert int(WHEEL_NAME.fullmatch(wheel.name)["glibc"]) == max(needed)


def test_the_library_links_nothing_outside_manylinux(library):
    dynamic = _readelf("--dynamic", str(library))
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))
    assert needed and needed <= MANYLINUX_LIBS, f"needs {sorted(needed - MANYLINUX_LIBS)}"
    undefined = [line.split()[7] for line in _readelf("--dyn-syms", str(library)).splitlines()
                 if len(line.split()) >= 8 and line.split()[6] == "UND"]
    foreign = [name for name in undefined
               if not re.search(r"@(GLIBC|GCC)_[\d.]+", name) and name not in WEAK_UNVERSIONED]
    assert not foreign, f"undefined symbols not from glibc or libgcc (torch's, CUDA's?): {foreign[:20]}"


def test_the_library_is_stripped_of_debug_sections(library):
    debug = re.findall(r"\] (\.debug_\w+)", _readelf("--section-headers", str(library)))
    assert not debug, f"debug sections in the packaged library: {debug}"


def test_the_wheel_holds_the_package_the_library_and_the_entry_point(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        entry_points = configparser.ConfigParser()
        entry_points.read_string(z.read(f"{info}/entry_points.txt").decode())
        meta = email.parser.Parser().parsestr(z.read(f"{info}/METADATA").decode())
    modules = {"deepwell/" + p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")}
    assert modules <= names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert [n for n in names if n.endswith(".so")] == ["deepwell/_deepwell.so"]
    assert dict(entry_points["torch_dynamo_backends"]) == {"deepwell": "deepwell.compiler.backend:backend"}
    assert meta["Requires-Python"] == ">=3.10"
    assert "torch>=2.10" in meta.get_all("Requires-Dist")


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """(the virtualenv's python, the environment to run it in): the wheel installed, no toolchain."""
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(root)])
    python = root / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    Path(purelib, "_outer_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("DEEPWELL_LIBRARY", "PYTHONPATH", "PYTHONHOME", "PYTEST_ADDOPTS", "VIRTUAL_ENV")}
    path = [str(root / "bin")] + [d for d in os.environ.get("PATH", "").split(os.pathsep)
                                  if d and not any(Path(d, tool).exists() for tool in ("cargo", "rustc"))]
    env.update(PATH=os.pathsep.join(path), VIRTUAL_ENV=str(root))
    assert not any(shutil.which(tool, path=env["PATH"]) for tool in ("cargo", "rustc"))
    # --force-reinstall: a `pip install .` of the same version in the outer site-packages (CI's)
    # would make pip skip the wheel. --no-index --no-deps: nothing is fetched; the dependencies are
    # checked against what the outer site-packages holds by the test of `import deepwell`.
    _run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--force-reinstall",
          str(wheel)], env=env, cwd=root)
    return python, env


def test_import_deepwell_finds_the_installed_package_and_library(venv, tmp_path):
    python, env = venv
    prefix = Path(python).parents[1]
    out = _run([str(python), "-c", (
        "import importlib.metadata as md, deepwell, deepwell._native as native\n"
        "from packaging.requirements import Requirement\n"
        "print(deepwell.__file__); print(native.library_path())\n"
        "for r in map(Requirement, md.requires('deepwell')):\n"
        "    if r.marker is None: assert r.specifier.contains(md.version(r.name), prereleases=True), r\n"
    )], env=env, cwd=tmp_path)
    module, library = out.split()
    assert Path(module).is_relative_to(prefix) and Path(library).is_relative_to(prefix), out
    assert Path(library).name == "_deepwell.so"


def test_the_entry_point_registers_the_backend_without_an_import(venv, tmp_path):
    python, env = venv
    out = _run([str(python), "-c", "import sys, torch._dynamo as d; f = d.lookup_backend('deepwell'); "
                "print(f.__module__, f.__name__, sys.modules[f.__module__].__file__)"], env=env, cwd=tmp_path)
    module, name, file = out.split()
    assert (module, name) == ("deepwell.compiler.backend", "backend")
    assert Path(file).is_relative_to(Path(python).parents[1]), out


def test_the_main_job_runs_from_the_wheel(venv, tmp_path):
    python, env = venv
    smallest = ["--quick", "--steps", "4", "--parity-steps", "0"]
    out = _run([str(python), "-m", "deepwell", *smallest, "--out", "run"], env=env, cwd=tmp_path)
    assert "bit-identical to the first run" in out and "export:" in out, out[-3000:]
    assert (tmp_path / "run" / "run-1" / "train" / "metrics.jsonl").is_file()


def test_a_subset_of_the_fast_tier_passes_against_the_wheel(venv):
    python, env = venv
    prefix = str(Path(python).parents[1])
    # The source tree's directory goes first on sys.path with `-m pytest`; it holds no `deepwell`
    # (that is torch_ops/deepwell), and the assertion makes sure the tests import the wheel's.
    _run([str(python), "-c", (
        "import sys, pytest, deepwell\n"
        f"assert deepwell.__file__.startswith({prefix!r}), deepwell.__file__\n"
        f"sys.exit(pytest.main(['-p', 'no:cacheprovider', *{FAST_SUBSET!r}]))\n"
    )], env=env, cwd=ROOT)
