"""Checkpoints and resume against a checkpoint directory someone edited (deepwell.train.checkpoint,
checkpoint_files, dcp_reader, sharded, dirlock, trainer): nothing a checkpoint or an artifact
holds runs as code, reads outside its directory, or hangs; a writer killed while re-saving loses
nothing; a guarded layer never resumes in another recipe than the model's; and each bad input is an
error that says what is wrong and what to do.

An editor who knows the format recomputes the manifest's hashes (`_rewrite`), so every case here
has a manifest whose own SHA-256 checks. Cases that could run code or hang run in one subprocess
(`hostile`) with an alarm per case and a timeout: a regression fails instead of hanging, and code
that runs can only create its marker file inside tmp_path, which the tests assert is absent."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deepwell
from _training import EagerEngine, engine
from deepwell.train import CheckpointError, Trainer, checkpoint

HERE = Path(__file__).resolve().parent  # tests/train; its parent, tests/, holds _training.py


# ---------------------------------------------------------------------------------------------
# A tiny trainer (no compile: fast) and an editor of manifests


class _Tiny(torch.nn.Module):
    def __init__(self, out: int = 8):
        super().__init__()
        self.fc = torch.nn.Linear(8, out)

    def forward(self, x):
        return self.fc(x)


def _square(eng, batch):
    return eng(batch).float().square().mean()


def data(n: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def tiny(directory, steps: int, model: torch.nn.Module | None = None, **kw) -> Trainer:
    torch.manual_seed(0)
    settings = {"loss_fn": _square, "progress": False, "plot": False, **kw}
    return Trainer.from_engine(EagerEngine(model if model is not None else _Tiny()), max_steps=steps, checkpoint_dir=directory, **settings)


def _rewrite(ckpt: Path, change=lambda m: None, after=lambda m: None) -> None:
    """Applies `change` to `ckpt`'s manifest, recomputes the hashes of the regular files it lists
    (wherever their names lead), applies `after`, and recomputes the manifest's own hash: what an
    editor who knows the format does."""
    m = json.loads((ckpt / "manifest.json").read_text())
    change(m)
    for name, entry in m.get("files", {}).items():
        f = ckpt / name
        if isinstance(entry, dict) and f.is_file():
            entry.update(bytes=f.stat().st_size, sha256=hashlib.sha256(f.read_bytes()).hexdigest())
    after(m)
    body = {k: v for k, v in m.items() if k != "sha256"}
    m["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").write_text(json.dumps(m))


class _Evil:
    """Pickles as a call that creates `marker`: what a hostile pickle does, made visible."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _dcp_metadata(step: Path):
    with open(step / "dcp" / ".metadata", "rb") as f:
        return pickle.load(f)  # our own file, just written: trusted


def _write_dcp_metadata(step: Path, metadata) -> None:
    with open(step / "dcp" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Checkpoint directories the tests copy: "full" (steps 1 and 2), "sharded" (step 1), and an
    export artifact of the tiny LLaMA."""
    root = tmp_path_factory.mktemp("bases")
    tiny(root / "full", 2, checkpoint_every=1).fit(data())
    tiny(root / "sharded", 1, checkpoint_format="sharded").fit(data())
    deepwell.export(engine(), root / "artifact")
    return root


# ---------------------------------------------------------------------------------------------
# What could run code or hang: one subprocess, an alarm per case

_RUNNER = r"""
import json, resource, signal, sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], str(Path(sys.argv[1]).parent)]
import test_checkpoint_trust as t

class Hung(BaseException):  # not an OSError: no `except OSError` in the code under test may swallow it
    pass

def hung(*_):
    raise Hung("no answer within 10 s: it hangs")

signal.signal(signal.SIGALRM, hung)
# Reading /dev/zero whole must fail here rather than take the machine's memory.
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
outcomes = {}
for name, (call, path) in json.loads(sys.argv[2]).items():
    signal.alarm(10)
    try:
        t.CALLS[call](Path(path))
        outcomes[name] = "returned"
    except BaseException as e:
        outcomes[name] = f"{type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
Path(sys.argv[3]).write_text(json.dumps(outcomes))
"""

CALLS = {
    "resume": lambda d: tiny(d, 3).fit(data(), resume=True),
    "verify": checkpoint.verify,
    "load": deepwell.load,
}


def _code_cases(root: Path, bases: Path) -> dict[str, tuple[str, Path, str]]:
    """name -> (call, path, what the error must say); each case's marker is <case dir>/marker."""
    cases = {}

    def case(name: str, base: str) -> tuple[Path, Path]:
        d = _copy(bases / base, root / name)
        return d, d / "marker"

    d, marker = case("metadata_payload_in_real_metadata", "sharded")
    md = _dcp_metadata(d / "step_00000001")
    md.planner_data["x"] = _Evil(marker)
    _write_dcp_metadata(d / "step_00000001", md)
    _rewrite(d / "step_00000001")
    cases[d.name] = ("resume", d, "not a checkpoint deepwell wrote")

    d, marker = case("metadata_payload_alone", "sharded")
    (d / "step_00000001" / "dcp" / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    _rewrite(d / "step_00000001")
    cases[d.name] = ("resume", d, "trust=True")

    # A non-tensor value (the optimizer's lr) that DCP's default planner would torch.load with
    # weights_only=False: its bytes now hold the payload, the metadata only data classes.
    d, marker = case("dcp_value_payload", "sharded")
    step = d / "step_00000001"
    md = _dcp_metadata(step)
    shard = step / "dcp" / "__0_0.distcp"
    info = next(v for k, v in md.storage_data.items() if k.fqn.endswith("param_groups.0.lr"))
    payload = io.BytesIO()
    torch.save(_Evil(marker), payload)
    info.offset, info.length = shard.stat().st_size, len(payload.getvalue())
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    _write_dcp_metadata(step, md)
    _rewrite(step)
    cases[d.name] = ("resume", d, "is not plain data")

    # A full checkpoint's manifest edited into a sharded one whose DCP files are elsewhere.
    for name, where in (("dcp_absolute", lambda d: str(d / "evil")), ("dcp_dotdot", lambda d: "../evil")):
        d, marker = case(name, "full")
        (d / "evil").mkdir()
        (d / "evil" / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
        _rewrite(d / "step_00000002", lambda m, w=where(d): m["state"].update(
            checkpoint_format="sharded", dcp=w, world_size=1, rng={"ranks": [m["state"]["rng"]]}))
        cases[d.name] = ("resume", d, "state.dcp must be 'dcp'")

    d, marker = case("dcp_symlinked_outside", "full")
    step = d / "step_00000002"
    (d / "evil").mkdir()
    (d / "evil" / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    (step / "dcp").symlink_to(d / "evil")
    shutil.copy(step / "rng.safetensors", step / "rng-rank0.safetensors")

    def as_sharded(m):
        m["state"].update(checkpoint_format="sharded", dcp="dcp", world_size=1, rng={"ranks": [m["state"]["rng"]]})
        m["files"].update({"dcp/.metadata": {}, "rng-rank0.safetensors": {}})

    _rewrite(step, as_sharded)
    cases[d.name] = ("resume", d, "symbolic link")
    return cases


def _hang_cases(root: Path, bases: Path) -> dict[str, tuple[str, Path, str]]:
    """Files that never end or never open: each used to hang (or exhaust memory) forever."""
    cases = {}

    def step2(name: str) -> Path:
        return _copy(bases / "full", root / name) / "step_00000002"

    def listing(entry: str):
        return lambda m: m["files"].update({entry: {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}})

    s = step2("files_entry_dev_zero")
    _rewrite(s, listing("/dev/zero"))
    cases["files_entry_dev_zero"] = ("verify", s, "not a path inside the checkpoint")

    s = step2("files_entry_symlink_to_dev_zero")
    (s / "zero.bin").symlink_to("/dev/zero")
    _rewrite(s, listing("zero.bin"))
    cases["files_entry_symlink_to_dev_zero"] = ("verify", s, "symbolic link")

    s = step2("files_entry_fifo")
    os.mkfifo(s / "pipe")
    _rewrite(s, listing("pipe"))
    cases["files_entry_fifo"] = ("verify", s, "is a FIFO")

    s = step2("latest_fifo")
    (s.parent / "latest").unlink()
    os.mkfifo(s.parent / "latest")
    cases["latest_fifo"] = ("resume", s.parent, "is a FIFO")

    s = step2("manifest_fifo")
    (s / "manifest.json").unlink()
    os.mkfifo(s / "manifest.json")
    cases["manifest_fifo"] = ("verify", s, "is a FIFO")

    s = step2("manifest_symlink_to_dev_zero")
    (s / "manifest.json").unlink()
    (s / "manifest.json").symlink_to("/dev/zero")
    cases["manifest_symlink_to_dev_zero"] = ("verify", s, "symbolic link")

    a = _copy(bases / "artifact", root / "artifact_dev_zero")
    _rewrite(a, listing("/dev/zero"))
    cases["artifact_dev_zero"] = ("load", a, "not a path inside the checkpoint")

    a = _copy(bases / "artifact", root / "artifact_manifest_fifo")
    (a / "manifest.json").unlink()
    os.mkfifo(a / "manifest.json")
    cases["artifact_manifest_fifo"] = ("load", a, "is a FIFO")
    return cases


@pytest.fixture(scope="module")
def hostile(bases, tmp_path_factory):
    """{case: (outcome, what the error must say, its marker)} for every case, run in one subprocess."""
    root = tmp_path_factory.mktemp("hostile")
    cases = {**_code_cases(root, bases), **_hang_cases(root, bases)}
    out = root / "outcomes.json"
    spec = json.dumps({name: (call, str(path)) for name, (call, path, _) in cases.items()})
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(HERE), spec, str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    outcomes = json.loads(out.read_text())
    return {name: (outcomes[name], phrase, root / name / "marker") for name, (_, _, phrase) in cases.items()}


CODE_CASES = ["metadata_payload_in_real_metadata", "metadata_payload_alone", "dcp_value_payload", "dcp_absolute", "dcp_dotdot",
              "dcp_symlinked_outside"]
HANG_CASES = ["files_entry_dev_zero", "files_entry_symlink_to_dev_zero", "files_entry_fifo", "latest_fifo", "manifest_fifo",
              "manifest_symlink_to_dev_zero", "artifact_dev_zero", "artifact_manifest_fifo"]


@pytest.mark.parametrize("case", CODE_CASES)
def test_code_in_a_checkpoint_never_runs(hostile, case):
    outcome, phrase, marker = hostile[case]
    assert not marker.exists(), f"{case}: the checkpoint ran code ({outcome})"
    assert outcome.startswith("CheckpointError") and phrase in outcome, outcome


@pytest.mark.parametrize("case", HANG_CASES)
def test_files_that_never_end_are_refused_without_hanging(hostile, case):
    outcome, phrase, _ = hostile[case]
    assert outcome.startswith("CheckpointError") and phrase in outcome, outcome


# ---------------------------------------------------------------------------------------------
# DCP metadata: what deepwell writes reads back; anything else needs trust=True


def test_the_restricted_reader_admits_what_dcp_writes_for_deepwell(bases):
    """The allow-list is the classes a real save names (traced), and no general callable."""
    from deepwell.train import dcp_reader

    seen = set()

    class Tracing(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(bases / "sharded" / "step_00000001" / "dcp" / ".metadata", "rb") as f:
        Tracing(f).load()
    assert seen and all(dcp_reader._allowed(m, n) for m, n in seen), sorted(seen)
    for module, name in [("builtins", "eval"), ("builtins", "getattr"), ("os", "system"), ("torch", "load"), ("io", "open"),
                         ("torch.serialization", "load"), ("posix", "system")]:
        assert not dcp_reader._allowed(module, name)


def test_trust_true_reads_a_sharded_checkpoint_deepwell_did_not_write(bases, tmp_path):
    d = _copy(bases / "sharded", tmp_path / "ckpt")
    md = _dcp_metadata(d / "step_00000001")
    md.planner_data["written_on"] = datetime.date(2024, 1, 1)  # harmless, but not what DCP writes for deepwell
    _write_dcp_metadata(d / "step_00000001", md)
    _rewrite(d / "step_00000001")
    with pytest.raises(CheckpointError, match=r"names datetime\.date.*not a checkpoint deepwell wrote.*trust=True"):
        tiny(d, 2).fit(data(), resume=True)
    t = tiny(d, 2)
    t.fit(data(), resume=True, trust=True)
    assert t.step == 2 and [r["step"] for r in t.history] == [1, 2]


# ---------------------------------------------------------------------------------------------
# Confinement of the manifest's names, and bounded reads


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_manifest_names_outside_the_checkpoint_are_refused(bases, tmp_path, kind):
    """A file outside, listed with its true size and hash, used to be read (and verified)."""
    secret = tmp_path / "outside.bin"
    secret.write_bytes(b"not the checkpoint's")

    def outside(ckpt: Path):
        name = os.path.relpath(secret, ckpt) if kind == "dotdot" else str(secret)
        return lambda m: m["files"].update({name: {}})

    step = _copy(bases / "full", tmp_path / "ckpt") / "step_00000002"
    _rewrite(step, outside(step))
    with pytest.raises(CheckpointError, match="is not a path inside the checkpoint"):
        checkpoint.verify(step)
    with pytest.raises(CheckpointError, match="is not a path inside the checkpoint"):
        tiny(step.parent, 3).fit(data(), resume=True)
    a = _copy(bases / "artifact", tmp_path / "artifact")
    _rewrite(a, outside(a))
    with pytest.raises(CheckpointError, match="is not a path inside the checkpoint"):
        deepwell.load(a)


def test_a_file_symlinked_outside_the_checkpoint_is_refused(bases, tmp_path):
    d = _copy(bases / "full", tmp_path / "ckpt")
    step = d / "step_00000002"
    shutil.move(step / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (step / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is, or lies under, a symbolic link"):
        tiny(d, 3).fit(data(), resume=True)
    a = _copy(bases / "artifact", tmp_path / "artifact")
    shutil.move(a / "weights.safetensors", tmp_path / "weights.safetensors")
    (a / "weights.safetensors").symlink_to(tmp_path / "weights.safetensors")
    with pytest.raises(CheckpointError, match=r"weights\.safetensors is, or lies under, a symbolic link"):
        deepwell.load(a)


def test_a_manifest_larger_than_its_bound_is_not_read(bases, tmp_path, monkeypatch):
    d = _copy(bases / "full", tmp_path / "ckpt")
    monkeypatch.setattr(checkpoint, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(CheckpointError, match=r"manifest\.json has \d+ bytes or more, more than the 100 a manifest can have"):
        checkpoint.verify(d / "step_00000002")


# ---------------------------------------------------------------------------------------------
# Edited and stale manifests name what is wrong


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.pop("files"), "the manifest has no 'files'"),
    (lambda m: m["state"].pop("rng"), "the manifest has no 'state.rng'"),
    (lambda m: m["state"]["quantization"].pop("guarded_layers"), "the manifest has no 'state.quantization.guarded_layers'"),
    (lambda m: m["files"].pop("model.safetensors"), "the manifest lists no model.safetensors"),
    (lambda m: m["files"]["optimizer.safetensors"].update(bytes="12"), "'files.optimizer.safetensors.bytes' is str '12', expected integer"),
    (lambda m: m["state"].update(checkpoint_format="zip"), "checkpoint_format must be 'full' or 'sharded'"),
], ids=["files", "rng", "guarded_layers", "model_file", "bytes_type", "format"])
def test_an_edited_manifest_names_the_bad_key(bases, tmp_path, edit, says):
    d = _copy(bases / "full", tmp_path / "ckpt")
    _rewrite(d / "step_00000002", after=edit)
    with pytest.raises(CheckpointError) as e:
        tiny(d, 3).fit(data(), resume=True)
    assert says in str(e.value)


def test_an_artifact_without_files_names_the_key(bases, tmp_path):
    a = _copy(bases / "artifact", tmp_path / "artifact")
    _rewrite(a, lambda m: m.pop("files"))
    with pytest.raises(CheckpointError, match="the manifest has no 'files'"):
        deepwell.load(a)


def test_a_stale_manifest_says_it_does_not_describe_the_files(bases, tmp_path):
    d = _copy(bases / "full", tmp_path / "ckpt")
    shutil.copy(d / "step_00000001" / "manifest.json", d / "step_00000002" / "manifest.json")
    with pytest.raises(CheckpointError, match="manifest.json describes step 1, not this directory's: it is stale"):
        tiny(d, 3).fit(data(), resume=True)
    d = _copy(bases / "full", tmp_path / "ckpt2")
    shutil.copy(d / "step_00000001" / "model.safetensors", d / "step_00000002" / "model.safetensors")  # same size
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupted or manifest\.json is stale"):
        tiny(d, 3).fit(data(), resume=True)


# ---------------------------------------------------------------------------------------------
# `latest` and checkpoint directory names


@pytest.mark.parametrize("kind", ["directory", "binary", "too_long", "symlink"])
def test_a_latest_that_is_not_a_pointer_is_a_checkpoint_error(bases, tmp_path, kind):
    d = _copy(bases / "full", tmp_path / "ckpt")
    latest = d / "latest"
    latest.unlink()
    if kind == "directory":
        latest.mkdir()
    elif kind == "binary":
        latest.write_bytes(b"\xff\xfe\x00step")
    elif kind == "too_long":
        latest.write_text("step_00000002" * 1000)
    else:
        latest.symlink_to(d / "step_00000002" / "manifest.json")
    says = {"directory": "is a directory, not a regular file", "binary": "expected the name of a checkpoint directory",
            "too_long": "more than the 256 a `latest` pointer", "symlink": "symbolic link"}[kind]
    with pytest.raises(CheckpointError, match=says):
        tiny(d, 3).fit(data(), resume=True)


def test_a_checkpoint_dir_named_like_a_step_resumes(tmp_path):
    d = tmp_path / "step_sweep"
    tiny(d, 1).fit(data())
    t = tiny(d, 2)
    t.fit(data(), resume=True)
    assert t.step == 2 and [r["step"] for r in t.history] == [1, 2]
    assert not checkpoint.is_checkpoint(d) and checkpoint.is_checkpoint(d / "step_00000001")


# ---------------------------------------------------------------------------------------------
# Data loss: re-saving a step


def _killed_after_first_rename(monkeypatch):
    """os.rename that lets one call through, then kills the process (SystemExit)."""
    calls, rename = [], os.rename

    def dies(*a, **k):
        calls.append(a)
        if len(calls) > 1:
            raise SystemExit("killed between the renames")
        return rename(*a, **k)

    monkeypatch.setattr(os, "rename", dies)
    return calls


def test_a_writer_killed_while_re_saving_a_step_loses_nothing(tmp_path, monkeypatch):
    t = tiny(tmp_path, 2, checkpoint_every=1)
    t.fit(data())
    _killed_after_first_rename(monkeypatch)
    with contextlib.suppress(SystemExit):  # the swap is one system call where the system has it
        t.save_checkpoint()
    monkeypatch.undo()
    assert checkpoint.verify(checkpoint.latest(tmp_path))["step"] == 2
    resumed = tiny(tmp_path, 3)
    resumed.fit(data(), resume=True)
    assert resumed.history[:2] == t.history[:2] and resumed.step == 3


def test_without_an_atomic_swap_the_checkpoint_moved_aside_is_recovered(tmp_path, monkeypatch):
    t = tiny(tmp_path, 2, checkpoint_every=1)
    t.fit(data())
    monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)
    _killed_after_first_rename(monkeypatch)
    with pytest.raises(SystemExit):
        t.save_checkpoint()
    monkeypatch.undo()
    assert not (tmp_path / "step_00000002").exists() and list(tmp_path.glob(".tmp-old-step_00000002-*"))
    resumed = tiny(tmp_path, 3)
    resumed.fit(data(), resume=True)  # puts step 2 back before reading `latest`
    assert resumed.history[:2] == t.history[:2] and resumed.step == 3
    assert not list(tmp_path.glob(".tmp-*")) and checkpoint.verify(tmp_path / "step_00000002")["step"] == 2


# ---------------------------------------------------------------------------------------------
# Silent wrong result: a guarded layer in another recipe


class _Guarded(torch.nn.Module):
    def __init__(self, recipe: str):
        super().__init__()
        self.fc = deepwell.Linear(64, 64, recipe=recipe, name=f"test_checkpoint_trust.fc.{recipe}",
                                  guardrail_config=deepwell.GuardrailConfig(interval=1))

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_a_guarded_layer_never_resumes_in_another_recipe(tmp_path, recipe):
    batches = [torch.randn(16, 64) for _ in range(4)]
    tiny(tmp_path, 2, model=_Guarded("mxfp8")).fit(batches)
    torch.manual_seed(1)
    fresh = _Guarded(recipe)
    before = fresh.fc.weight.detach().clone()
    with pytest.raises(ValueError, match=rf"deepwell.Linear 'fc' in mxfp8, but the model builds it in {recipe}: build the layer with recipe='mxfp8'"):
        tiny(tmp_path, 4, model=fresh).fit(batches, resume=True)
    assert fresh.fc.guardrail.recipe == recipe and torch.equal(fresh.fc.weight, before)  # nothing loaded


# ---------------------------------------------------------------------------------------------
# Unclear errors made clear


def test_resuming_with_less_data_than_the_checkpoint_used(tmp_path):
    tiny(tmp_path, 4).fit(data(4))
    with pytest.raises(ValueError, match=r"the training data has 2 batches, but the checkpoint .*step_00000004 already used 4"):
        tiny(tmp_path, 6).fit(data(2), resume=True)


def test_a_sharded_checkpoint_into_another_shape_is_a_checkpoint_error(bases, tmp_path):
    d = _copy(bases / "sharded", tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="does not fit this model and optimizer"):
        tiny(d, 2, model=_Tiny(out=4)).fit(data(), resume=True)


def test_two_trainers_on_one_directory(tmp_path):
    second = tiny(tmp_path, 1)
    refused = []

    def loss_and_a_second_run(eng, batch):
        if not refused:
            with pytest.raises(CheckpointError) as e:
                second.fit(data())
            refused.append(str(e.value))
        return _square(eng, batch)

    first = tiny(tmp_path, 2, checkpoint_every=1, loss_fn=loss_and_a_second_run)
    first.fit(data())
    assert f"checkpoint_dir {tmp_path} is in use by another Trainer (pid {os.getpid()} on" in refused[0]
    assert "its own checkpoint_dir" in refused[0]
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    second.fit(data())  # the first released the directory when it finished


def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path):
    from deepwell.train.dirlock import DirectoryLock

    # What DirectoryLock does, in a process that then dies without releasing anything.
    code = ("import fcntl, os, sys; fd = os.open(os.path.join(sys.argv[1], '.lock'), os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); os.write(fd, b'pid %d' % os.getpid()); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    assert (tmp_path / ".lock").read_text().startswith("pid ")
    t = tiny(tmp_path, 1)
    t.fit(data())
    lock = DirectoryLock(tmp_path).acquire()  # released again when the Trainer finished
    assert t.step == 1 and lock.held
    lock.release()


def test_an_edited_plan_in_the_manifest_is_a_checkpoint_error(tmp_path):
    """The plan a checkpoint trained with is compared with the engine's: an edited one says so."""
    import types

    t = tiny(tmp_path / "ckpt", 1)
    t.engine = types.SimpleNamespace(plan=types.SimpleNamespace(sites=[types.SimpleNamespace(name="w1", recipe="mxfp8")]))
    with pytest.raises(CheckpointError, match=r"state.plan.sites must be a list of \{name, recipe\} objects"):
        t._check_plan({"plan": {"sites": [{"bogus": 1}]}}, tmp_path)
