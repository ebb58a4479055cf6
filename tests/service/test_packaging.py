"""The package as a user installs it: a wheel built from the tree carries the generated protobuf
code (grpcio-tools runs at build time), the kernels' C sources and the workloads; and the client
alone needs only grpcio and protobuf: in a fresh venv with nothing else, it calls a real router."""

import subprocess
import sys
import zipfile

import pytest

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "TMPDIR": str(build)},
    )
    assert run.returncode == 0, run.stderr
    (path,) = out.glob("splitserve-*.whl")
    return path


def test_the_wheel_carries_the_generated_stubs_the_kernels_and_the_workloads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for stub in ("generation_pb2.py", "generation_pb2_grpc.py", "worker_pb2.py", "worker_pb2_grpc.py"):
        assert f"splitserve_proto/v1/{stub}" in names, stub
    assert "splitserve/router/http_api.py" in names and "splitserve/decode_worker/server.py" in names
    assert any(n.startswith("splitserve/engine/native/") and n.endswith(".c") for n in names)
    assert "splitserve/bench/workloads/workload_mixed.jsonl" in names
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [line for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines() if line.startswith("Requires")]
    for dep in ("grpcio-status", "starlette", "uvicorn", "tokenizers", "jinja2"):
        assert any(dep in line.lower() for line in requires), dep


def test_a_client_only_install_imports_no_torch_and_calls_a_router(wheel, tmp_path, stack):
    venv = tmp_path / "client-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q"]
    deps = subprocess.run([*pip, "grpcio==1.85.1", "protobuf", "googleapis-common-protos"], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert deps.returncode == 0, deps.stderr
    own = subprocess.run([*pip, "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300)
    assert own.returncode == 0, own.stderr
    script = (
        "import sys\n"
        "from splitserve.client import Client, InvalidArgument\n"
        f"with Client({stack.router_address!r}) as c:\n"
        "    r = c.generate('The capital of France is', max_tokens=3, ignore_eos=True)\n"
        "    try:\n"
        "        c.generate('x', max_tokens=-1)\n"
        "    except InvalidArgument as e:\n"
        "        print(e.field_violations[0][0])\n"
        "print(r.usage.completion_tokens)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'redis') if m in sys.modules))\n"
    )
    run = subprocess.run([py, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:3] == ["sampling.max_tokens", "3", "[]"]
    torch = subprocess.run([py, "-c", "import torch"], capture_output=True, timeout=60)
    assert torch.returncode != 0  # not installed: nothing above could have used it
