"""deepwell.export / deepwell.load with hostile or careless inputs: an artifact is shared, so loading
one never imports or runs what it names and checks every value of its manifest; export never
deletes what deepwell did not write. The code-execution cases run `deepwell.load` in a subprocess
whose payload would create a marker file, and assert that it was not created."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import deepwell
from _training import CONFIG, engine
from deepwell.train import CheckpointError


@pytest.fixture(scope="module")
def eng():
    return engine("mxfp8")


@pytest.fixture
def artifact(eng, tmp_path):
    return deepwell.export(eng, tmp_path / "art")


def _edit_manifest(path, edit) -> None:
    """Applies `edit` to the artifact's manifest and re-signs it as its writer would: the manifest's
    SHA-256 covers only itself, so anyone can do this."""
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    edit(manifest)
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    body_bytes = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    manifest_path.write_text(json.dumps({**body, "sha256": hashlib.sha256(body_bytes).hexdigest()}, indent=1))


def _load_in_subprocess(cwd, path) -> subprocess.CompletedProcess:
    """`deepwell.load(path)` in a fresh interpreter whose working directory is `cwd` (so a module the
    artifact ships would be importable from it, as `python -c` puts the working directory first)."""
    code = textwrap.dedent(f"""
        import deepwell
        try:
            deepwell.load({str(path)!r})
        except (ValueError, RuntimeError) as e:
            print("REFUSED:", e)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------------------------------------
# Loading runs nothing the artifact names


def test_a_model_class_outside_deepwell_is_never_imported(artifact, tmp_path):
    """`model.class = "this.Foo"`: importing `this` prints the Zen of Python."""
    _edit_manifest(artifact, lambda m: m["model"].update({"class": "this.Foo"}))
    done = _load_in_subprocess(tmp_path, artifact)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Beautiful is better than ugly" not in done.stdout
    assert "REFUSED: deepwell.load:" in done.stdout and "'this.Foo'" in done.stdout and "model_cls=" in done.stdout


def test_a_module_shipped_in_the_artifact_never_runs(artifact, tmp_path):
    """The artifact ships `evil.py` and names `art.evil.Net`: importing it would create the marker."""
    marker = tmp_path / "marker"
    (artifact / "__init__.py").write_text("")
    (artifact / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\nimport torch\nNet = torch.nn.Linear\n")
    _edit_manifest(artifact, lambda m: m["model"].update({"class": "art.evil.Net"}))
    done = _load_in_subprocess(tmp_path, artifact)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists()
    assert "REFUSED:" in done.stdout and "'art.evil.Net'" in done.stdout


def test_a_caller_given_class_builds_from_the_recorded_config(eng, artifact):
    _edit_manifest(artifact, lambda m: m["model"].update({"class": "somewhere.Else"}))
    loaded = deepwell.load(artifact, model_cls=type(eng.model))
    assert torch.equal(loaded.tok_embeddings.weight, eng.model.tok_embeddings.weight)
    with pytest.raises(ValueError, match="model_cls must be an nn.Module subclass, got 'os.system'"):
        deepwell.load(artifact, model_cls="os.system")


def test_a_config_edited_to_other_sizes_allocates_nothing(artifact):
    """A config of 2^40 embeddings would ask for terabytes: the meta-device build finds it first."""
    _edit_manifest(artifact, lambda m: m["model"]["config"].update({"vocab": 2**40}))
    with pytest.raises(ValueError, match=r"recorded config builds \S+ as \(1099511627776, 128\), the artifact stores \(256, 128\)"):
        deepwell.load(artifact)
    _edit_manifest(artifact, lambda m: m["model"]["config"].update({"vocab": 256, "no_such_argument": 1}))
    with pytest.raises(ValueError, match="cannot be built from the recorded config"):
        deepwell.load(artifact)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda m: m["model"].update({"dtype": "load"}), r"model 'dtype' must be one of .*got 'load'"),
        (lambda m: m.update({"model": "x"}), r"'model' must be an object with a 'class' string"),
        (lambda m: m["model"].update({"config": [1]}), r"model 'config' must be an object or null, got list"),
        (lambda m: m.update({"quantized_sites": []}), r"'quantized_sites' must be an object, got list"),
        (lambda m: m["quantized_sites"].update({"layers.0.feed_forward.w1": {"recipe": "fp7", "in_features": 1, "out_features": 1}}),
         r"quantized site 'layers.0.feed_forward.w1' must be \{recipe: one of"),
        (lambda m: m.update({"aliases": {"a": 1}}), r"'aliases' must map names to names"),
        (lambda m: m.pop("plan"), r"the manifest has no 'plan'"),
    ],
    ids=["dtype", "model", "config", "sites", "recipe", "aliases", "plan"],
)
def test_an_edited_manifest_is_a_clear_error(artifact, edit, match):
    _edit_manifest(artifact, edit)
    with pytest.raises(CheckpointError, match=match):
        deepwell.load(artifact)


def test_an_unknown_site_name_names_the_site(artifact):
    site = {"recipe": "mxfp8", "in_features": 128, "out_features": 128}
    _edit_manifest(artifact, lambda m: m["quantized_sites"].update({"layers.9.nothing": site}))
    with pytest.raises(CheckpointError, match=r"quantized site 'layers.9.nothing' \(128 x 128\) is not a weight of that shape"):
        deepwell.load(artifact)
    fresh = CONFIG.build(torch.device("cpu"), seed=1)
    with pytest.raises(CheckpointError, match=r"quantized site 'layers.9.nothing' \(128 x 128\) is not an nn.Linear of that shape"):
        deepwell.load(artifact, model=fresh)


def test_stored_codes_of_the_wrong_shape_are_refused(artifact):
    """A site's features edited: the stored codes no longer have the shape its recipe makes."""
    def widen(m):
        name = next(iter(m["quantized_sites"]))
        m["quantized_sites"][name]["in_features"] *= 2

    _edit_manifest(artifact, widen)
    with pytest.raises(CheckpointError, match=r"quantized site '.*' \(\d+ x \d+\) is not a weight of that shape"):
        deepwell.load(artifact)


# ---------------------------------------------------------------------------------------------
# Export never deletes what deepwell did not write


def test_export_refuses_a_directory_holding_other_files(eng, tmp_path):
    target = tmp_path / "project"
    (target / "src").mkdir(parents=True)
    (target / "src" / "precious.py").write_text("keep me\n")
    with pytest.raises(FileExistsError, match="not a deepwell artifact.*never deletes files it did not write"):
        deepwell.export(eng, target)
    with pytest.raises(FileExistsError):
        deepwell.export(eng, target, overwrite=True)
    assert (target / "src" / "precious.py").read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # nothing left beside it


def test_export_refuses_an_existing_file_and_a_link(eng, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("mine\n")
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        deepwell.export(eng, f, overwrite=True)
    assert f.read_text() == "mine\n"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        deepwell.export(eng, tmp_path / "link")


def test_export_replaces_only_its_own_artifact_and_only_when_asked(eng, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    path = deepwell.export(eng, empty)  # an empty directory is taken
    with pytest.raises(FileExistsError, match="already holds a deepwell artifact; pass overwrite=True"):
        deepwell.export(eng, path)
    assert deepwell.export(eng, path, overwrite=True) == path
    deepwell.load(path)
    (path / "README.txt").write_text("a note the user added\n")
    with pytest.raises(FileExistsError, match="holds files its manifest does not list"):
        deepwell.export(eng, path, overwrite=True)
    assert (path / "README.txt").exists()
