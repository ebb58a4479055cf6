"""The container image, run the way the dev and cross-node overlays run it.

Each overlay is rendered with kustomize; every container of its router and worker Deployments
runs from the image with podman, with what its manifest sets: the command, the ConfigMap and
env (field and secret references resolved), the user, a read-only root filesystem, all
capabilities dropped, no privilege escalation, and its emptyDirs (a memory-backed one at
/dev/shm, shared by the containers of one pod, as the manifest has it). A real Redis with AUTH
stands in for the in-cluster one and an OTLP/gRPC collector in this test for the trace
collector. Ports become free ports of 127.0.0.1 (every container is on the host's network).

Needs a built image, named by SPLITSERVE_IMAGE, and root for podman and the tmpfs mounts:
`make image-test` builds one (deploy/docker/build-local.sh) and runs this file. Without an
image these tests are skipped, so `make test` reports them as skipped.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent import futures

import grpc
import pytest
import yaml

from splitserve.client import Client
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling import SamplingParams
from splitserve.stack import Stack, redis_server_binary

IMAGE = os.environ.get("SPLITSERVE_IMAGE", "")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This host's quirks, not the image's: crun refuses its hybrid cgroup layout (runc does not),
# and its rlimits cannot be raised (no CAP_SYS_RESOURCE) while podman raises them by default.
PODMAN_RUN = os.environ.get(
    "SPLITSERVE_PODMAN_RUN", "podman --runtime runc run --ulimit nofile=16384:16384 --ulimit nproc=4096:4096"
).split()

pytestmark = pytest.mark.skipif(
    not IMAGE or shutil.which("podman") is None or os.geteuid() != 0,
    reason="needs a built image in SPLITSERVE_IMAGE, podman and root: `make image-test`",
)


_GIVEN: set[int] = set()  # ports handed out by _free_port


def _free_port() -> int:
    """A free port below the kernel's ephemeral range. One the kernel hands out (bind to 0) may be
    taken, before the container that is to listen on it starts, as the source port of another
    container's outgoing connection (CI: the decode worker failed to bind its port)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = secrets.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _GIVEN:  # not bound yet by the one it went to
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError("no free port found below the ephemeral range")


def _size(limit: str) -> str:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", limit)
    assert m, limit
    return m.group(1) + {"Ki": "k", "Mi": "m", "Gi": "g", None: ""}[m.group(2)]


class Collector:
    """An OTLP/gRPC trace collector on a free port: every span it receives, with its resource."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        spans = self.spans = []  # (trace id hex, span name, resource attributes)

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                for rs in request.resource_spans:
                    attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        spans.extend((s.trace_id.hex(), s.name, attrs) for s in ss.spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


class Cluster:
    """The overlay's router and worker pods as podman containers on this host's network."""

    def __init__(self, overlay: str):
        self.overlay = overlay
        out = subprocess.run(
            ["kubectl", "kustomize", os.path.join(REPO, "deploy", "k8s", "overlays", overlay)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        self.docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        self.tag = f"splitserve-test-{secrets.token_hex(3)}"
        self.dir = tempfile.mkdtemp(prefix=f"{self.tag}-")
        self.mounts: list[str] = []
        self.containers: list[str] = []
        self.redis: subprocess.Popen | None = None
        self.collector: Collector | None = None
        self.ports: dict[str, int] = {}  # a port of the manifests -> the free port standing for it
        self.router_address = ""

    def deployments(self) -> list[dict]:
        return [d for d in self.docs if d["kind"] == "Deployment" and d["metadata"]["name"] != "splitserve-redis"]

    def start(self, timeout: float = 300) -> Cluster:
        password = secrets.token_hex(8)
        port = _free_port()
        self.redis = subprocess.Popen(
            [
                redis_server_binary(),
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
                "--requirepass",
                password,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.redis_url = f"redis://:{password}@127.0.0.1:{port}/0"
        self.collector = Collector()
        config = {d["metadata"]["name"]: d.get("data", {}) for d in self.docs if d["kind"] == "ConfigMap"}
        addresses = []  # every container's gRPC port, as its probes check it
        for dep in self.deployments():
            for c in dep["spec"]["template"]["spec"]["containers"]:
                for p in c.get("ports", []):
                    port = self.ports.setdefault(str(p["containerPort"]), _free_port())
                    if "grpc" in p.get("name", ""):
                        addresses.append(f"127.0.0.1:{port}")
        for dep in self.deployments():
            self._run_pod(dep, config)
        self.router_address = f"127.0.0.1:{self.ports['50051']}"
        deadline = time.time() + timeout
        while not all(Stack._healthy(a) for a in addresses):
            dead = [c for c in self.containers if self.inspect(c, "Status") != "running"]
            assert not dead, f"{dead} stopped:\n" + "\n".join(self.logs(c) for c in dead)
            assert time.time() < deadline, "containers not healthy in time:\n" + "\n".join(
                map(self.logs, self.containers)
            )
            time.sleep(0.5)
        time.sleep(2)  # the router reads the worker registry every half heartbeat
        return self

    def _remap(self, value: str) -> str:
        return re.sub(r"\b(\d{4,5})\b", lambda m: str(self.ports.get(m.group(1), m.group(1))), value)

    def _run_pod(self, dep: dict, config: dict) -> None:
        pod = dep["spec"]["template"]["spec"]
        pod_name = f"{dep['metadata']['name']}-{self.tag}"
        volumes = {}
        for v in pod.get("volumes", []):
            path = os.path.join(self.dir, f"{dep['metadata']['name']}-{v['name']}")
            os.makedirs(path)
            empty = v["emptyDir"]
            if empty.get("medium") == "Memory":
                subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", f"size={_size(empty['sizeLimit'])},mode=1777", "tmpfs", path],
                    check=True,
                )
                self.mounts.append(path)
            else:
                os.chmod(path, 0o1777)
            volumes[v["name"]] = path
        psc = pod.get("securityContext", {})
        first = ""  # the containers of a pod share its hostname and IPC namespace, as a pod's do
        for c in pod["containers"]:
            sc = c.get("securityContext", {})
            env: dict[str, str] = {}
            for ref in c.get("envFrom", []):
                env.update({k: self._remap(v) for k, v in config[ref["configMapRef"]["name"]].items()})
            fields = {
                "status.podIP": "127.0.0.1",
                "metadata.name": pod_name,
                "metadata.namespace": dep["metadata"]["namespace"],
            }
            for e in c.get("env", []):
                if "value" in e:  # $(NAME) expands the container's variables defined before it, as the kubelet does
                    value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), self._remap(e["value"]))
                elif "fieldRef" in e["valueFrom"]:
                    value = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
                else:
                    assert e["valueFrom"]["secretKeyRef"]["name"].startswith("splitserve-redis-url"), e
                    value = self.redis_url
                env[e["name"]] = value
            env["SPLITSERVE_HOST"] = "127.0.0.1"  # the host's network, not a pod's
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{self.collector.port}"
            env["OTEL_BSP_SCHEDULE_DELAY"] = "200"
            name = f"{pod_name}-{c['name']}"
            args = [
                *PODMAN_RUN,
                "-d",
                "--name",
                name,
                "--network",
                "host",
                "--user",
                f"{sc.get('runAsUser', psc['runAsUser'])}:{sc.get('runAsGroup', psc['runAsGroup'])}",
            ]
            if first:
                args += ["--ipc", f"container:{first}", "--uts", f"container:{first}"]
            else:
                args += ["--ipc", "shareable", "--hostname", pod_name[:63]]
                first = name
            if sc.get("readOnlyRootFilesystem"):
                args.append("--read-only")
            if sc.get("capabilities", {}).get("drop") == ["ALL"]:
                args += ["--cap-drop", "ALL"]
            if sc.get("allowPrivilegeEscalation") is False:
                args += ["--security-opt", "no-new-privileges"]
            for m in c.get("volumeMounts", []):
                args += ["-v", f"{volumes[m['name']]}:{m['mountPath']}"]
            for k, v in env.items():
                args += ["--env", f"{k}={v}"]
            subprocess.run([*args, IMAGE, *c["command"]], check=True, capture_output=True, timeout=60)
            self.containers.append(name)

    def inspect(self, name: str, state: str) -> str:
        """A field of the container's state: Status, ExitCode, ..."""
        out = subprocess.run(
            ["podman", "inspect", "--format", f"{{{{.State.{state}}}}}", name], capture_output=True, text=True
        )
        return out.stdout.strip()

    def logs(self, name: str) -> str:
        out = subprocess.run(["podman", "logs", "--tail", "30", name], capture_output=True, text=True)
        return f"--- {name}\n{out.stdout}{out.stderr}"

    def exec(self, name: str, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", "exec", name, *cmd], capture_output=True, text=True, timeout=60)

    def shm_files(self) -> list[str]:
        return [f for m in self.mounts for f in os.listdir(m)]

    def stop(self) -> None:
        """SIGTERM to every container, the router first (as a rollout would); each has 60 s to drain."""
        order = sorted(self.containers, key=lambda n: "router" not in n)
        for name in order:
            subprocess.run(["podman", "stop", "-t", "60", name], capture_output=True, timeout=120)

    def remove(self) -> None:
        for name in reversed(self.containers):  # a pod's first container last: the others join its namespaces
            subprocess.run(["podman", "rm", "-f", name], capture_output=True, timeout=120)
        for path in self.mounts:
            subprocess.run(["umount", path], capture_output=True)
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(10)
        if self.collector is not None:
            self.collector.server.stop(0)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def expected(smol_loaded):
    prompts = [list(range(1000, 1000 + n)) for n in (5, 37, 120)]
    eng = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20), loaded=smol_loaded)
    return prompts, eng.generate(prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts))


@pytest.mark.parametrize("overlay, transport", [("dev", "shm"), ("cross-node", "grpc")])
def test_overlay_runs_from_the_image(overlay, transport, expected):
    prompts, outputs = expected
    cluster = Cluster(overlay)
    try:
        cluster.start()
        with Client(cluster.router_address) as c:
            got = [c.generate(token_ids=p, max_tokens=12, ignore_eos=True, timeout=120) for p in prompts]
            assert [list(r.token_ids) for r in got] == outputs  # the image serves the model token for token
            infos = [c.get_request(r.request_id) for r in got]
        assert all(i.state == "finished" and i.kv_transport == transport and i.kv_bytes > 0 for i in infos), infos

        for name in cluster.containers:  # what the manifests ask of every container
            assert cluster.exec(name, "id", "-u").stdout.strip() == "10001"
            denied = cluster.exec(name, "sh", "-c", "touch /probe")
            assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied
            assert cluster.exec(name, "sh", "-c", "touch /tmp/probe").returncode == 0
            status = cluster.exec(name, "grep", "-E", "^(CapEff|NoNewPrivs)", "/proc/1/status").stdout.split()
            assert status == ["CapEff:", "0000000000000000", "NoNewPrivs:", "1"], status

        # One trace per request across the three processes, sent to the OTLP endpoint.
        trace_id = None
        deadline = time.time() + 30
        while time.time() < deadline:
            by_trace: dict[str, set[str]] = {}
            for tid, _, attrs in list(cluster.collector.spans):
                by_trace.setdefault(tid, set()).add(attrs.get("k8s.container.name", ""))
            full = [t for t, names in by_trace.items() if {"router", "prefill", "decode"} <= names]
            if len(full) >= len(prompts):
                trace_id = full[0]
                break
            time.sleep(0.5)
        assert trace_id, f"no trace reached the collector from all three processes: {by_trace}"
        pods = {attrs.get("k8s.pod.name", "") for tid, _, attrs in cluster.collector.spans if tid == trace_id}
        assert all(p.endswith(cluster.tag) for p in pods), pods

        cluster.stop()
        assert {n: cluster.inspect(n, "ExitCode") for n in cluster.containers} == {n: "0" for n in cluster.containers}
        assert cluster.shm_files() == []  # no shared-memory segment outlives its pod's processes
    finally:
        cluster.stop()
        cluster.remove()
    left = subprocess.run(
        ["podman", "ps", "-a", "--filter", f"name={cluster.tag}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert left == []
