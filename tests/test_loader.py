"""Model loading: one clear error line for every way it can go wrong."""

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
from engine_helpers import mapped_from

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


def test_a_gguf_files_digest_is_kept_by_its_identity_once_it_has_settled(tmp_path):
    """Hashing the default GGUF file took each process 0.2 s at its start: its digest is kept, by
    the file's device, inode, size and mtime, once the file has not been written for a while."""
    from splitserve.engine import loader

    path = tmp_path / "m.gguf"
    path.write_bytes(os.urandom(1 << 20))
    cache = str(tmp_path / "cache")
    fresh = loader._cache_folder(str(path), cache)
    assert not (tmp_path / "cache" / "digests").exists()  # just written: not kept
    old = time.time() - 2 * loader.DIGEST_SETTLED_S
    os.utime(path, (old, old))
    assert loader._cache_folder(str(path), cache) == fresh
    (memo,) = (tmp_path / "cache" / "digests").iterdir()
    assert memo.read_text() == hashlib.blake2b(path.read_bytes()).hexdigest()
    memo.write_text("0" * 128)  # the kept digest is the one used ...
    assert loader._cache_folder(str(path), cache) != fresh
    data = bytearray(path.read_bytes())  # ... until the file is written again
    data[7] ^= 1
    path.write_bytes(bytes(data))
    changed = os.path.basename(loader._cache_folder(str(path), cache))
    assert changed != os.path.basename(fresh)
    # hashed afresh: as a cache that never kept a digest of it names it
    assert changed == os.path.basename(loader._cache_folder(str(path), str(tmp_path / "other")))


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


def test_the_weights_laid_out_are_kept_mapped_from_disk_and_made_again_when_they_do_not_fit(tmp_path, smol_loaded):
    """Making the engine's layout (q, k, v and gate, up fused, each [in, out]) from the converted
    folder cost each worker ~1 s of CPU at its start: the first process keeps it (layout_cache)
    and the later ones map it from the file, with the same weights. One that does not fit the
    model (another layout, a torn entry) is made again."""
    import dataclasses

    import torch

    from splitserve.engine import layout_cache
    from splitserve.engine.model import LlamaModel

    loaded = dataclasses.replace(smol_loaded, laid_out={}, packed={})
    made = LlamaModel(loaded)
    assert made.made_layout
    dest = layout_cache.entry(str(tmp_path), "/cache/models/SmolLM2-abc")
    assert layout_cache.read(dest) is None  # no entry yet
    layout_cache.write(dest, made.laid_out())
    path = os.path.join(dest, layout_cache.FILE)
    assert os.stat(dest).st_mode & 0o777 == 0o755 and os.stat(path).st_mode & 0o004
    laid = layout_cache.read(dest)
    assert set(laid) == set(made.laid_out()) and len(laid) == 1 + 4 * made.shape.num_layers
    taken = LlamaModel(loaded, laid)
    assert not taken.made_layout
    for name, want in made.laid_out().items():
        assert torch.equal(taken.laid_out()[name], want), name
    # mapped from the file, not read into memory
    assert all(mapped_from(t, path) for t in taken.laid_out().values())
    assert taken.fingerprint == made.fingerprint
    laid["3.w_down"] = laid["3.w_down"].t().contiguous()  # [out, in]: not this model's layout
    again = LlamaModel(loaded, laid)
    assert again.made_layout and torch.equal(again.layers[3].w_down, made.layers[3].w_down)
    with open(path, "r+b") as f:  # a torn file
        f.truncate(1000)
    assert layout_cache.read(dest) is None
