"""Model loading: one clear error line for every way it can go wrong."""

import json
import os
import subprocess
import sys

import pytest

from splitserve.engine.config import ModelSpec
from splitserve.engine.errors import ModelLoadError
from splitserve.engine.loader import load_model


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(ModelSpec(path=str(tmp_path / "nope")))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(ModelLoadError, match="corrupt or unreadable GGUF"):
        load_model(ModelSpec(path=str(bad), cache_dir=str(tmp_path / "cache")))


def test_unsupported_architecture(tmp_path, tiny_model_dir):
    folder = tmp_path / "gpt2ish"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'.*llama, mistral, qwen2"):
        load_model(ModelSpec(path=str(folder)))


def test_corrupt_safetensors(tmp_path, tiny_model_dir):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(open(os.path.join(tiny_model_dir, "config.json")).read())
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="corrupt weights file"):
        load_model(ModelSpec(path=str(folder)))


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="expected a .gguf file"):
        load_model(ModelSpec(path=str(f)))


def test_cli_prints_one_line_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "check-model", "--model", str(tmp_path / "missing.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines == [f"splitserve: error: model path does not exist: {tmp_path / 'missing.gguf'}"]


def test_gguf_cache_is_keyed_by_content_not_path(tmp_path):
    """Two installs of the same GGUF share one converted copy; a changed file gets its own."""
    import shutil
    import time

    from splitserve.engine.loader import _cache_folder

    a = tmp_path / "venv-a" / "m.gguf"
    b = tmp_path / "venv-b" / "m.gguf"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_bytes(os.urandom(1 << 20))
    time.sleep(0.01)
    shutil.copyfile(a, b)  # another path, another mtime
    assert os.stat(a).st_mtime_ns != os.stat(b).st_mtime_ns
    cache = str(tmp_path / "cache")
    assert _cache_folder(str(a), cache) == _cache_folder(str(b), cache)
    data = bytearray(b.read_bytes())
    data[len(data) // 2] ^= 1
    b.write_bytes(bytes(data))
    assert _cache_folder(str(a), cache) != _cache_folder(str(b), cache)


def test_check_model_fills_the_cache_dir_the_workers_read(tmp_path, tiny_model_dir):
    """`splitserve check-model` bakes an image's cache: under SPLITSERVE_CACHE_DIR, as the workers
    read it (Settings), not under HOME."""
    from splitserve.service.settings import Settings

    env = dict(os.environ, SPLITSERVE_CACHE_DIR=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "check-model", "--model", tiny_model_dir],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert Settings.from_env(env).cache_dir == str(tmp_path / "cache")
    kernels = sorted(os.listdir(tmp_path / "cache" / "kernels"))
    assert [k.split("-")[0] for k in kernels] == ["paged_attention", "small_gemm"], kernels
    assert not (tmp_path / "home").exists()


def test_converted_model_folder_is_readable_by_other_users(smol_folder):
    """An image bakes the converted model as root and runs as another user: mkdtemp's 0700 was
    not readable there, so every start tried to convert again (into a read-only filesystem).
    The folder checked is the one this session's model was converted into (by this run, on a
    fresh machine such as CI's): converting again here took half a minute."""
    folder = smol_folder
    assert os.path.exists(os.path.join(folder, "model.safetensors"))
    assert os.stat(folder).st_mode & 0o777 == 0o755
    assert all(os.stat(os.path.join(folder, f)).st_mode & 0o004 for f in os.listdir(folder))


def test_corrupt_tokenizer(tmp_path, smol_folder):
    import shutil

    from splitserve.engine.tokenizer import load_tokenizer

    folder = tmp_path / "badtok"
    shutil.copytree(smol_folder, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "tokenizer.json").write_text('{"model": "truncated')
    with pytest.raises(ModelLoadError, match=f"cannot load tokenizer in {folder}"):
        load_tokenizer(str(folder))
    (folder / "tokenizer.json").write_text(open(f"{smol_folder}/tokenizer.json").read())
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=f"cannot load tokenizer in {folder}"):
        load_tokenizer(str(folder))
