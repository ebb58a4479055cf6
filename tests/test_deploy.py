"""Deploy manifests: render every overlay, validate against the Kubernetes schemas, checkov,
and cross-check every environment variable against what the code reads."""

import base64
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from splitserve.observability.metrics import DecodeMetrics
from splitserve.observability.tracing import OTEL_ENV
from splitserve.service.redis_state import Keys
from splitserve.service.settings import Settings, env_name

REPO = pathlib.Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
TOOLS = REPO / ".venv-deploy" / "bin"
OVERLAYS = ["dev", "gpu", "cross-node", "secure"]
K8S_VERSION = "1.31"
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
CERT_MANAGER_KINDS = {"Certificate", "Issuer"}  # CRDs: checked by test_tls_objects_are_well_formed


def _tool(name: str) -> str:
    path = TOOLS / name
    assert path.exists(), f"{path} is missing: run `make deploy-tools` (make test does)"
    return str(path)


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request, tmp_path_factory):
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with kustomize built in) is needed to render the overlays"
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / request.param)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    folder = tmp_path_factory.mktemp(request.param)
    path = folder / "all.yaml"
    path.write_text(out.stdout)
    return request.param, docs, path


def test_overlay_renders_the_expected_objects(rendered):
    name, docs, _ = rendered
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "splitserve-router") in kinds
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    # clients that balance over the routers resolve the headless one: one address per ready router
    assert services["splitserve-router-headless"]["clusterIP"] == "None"
    assert services["splitserve-router-headless"]["selector"] == services["splitserve-router"]["selector"]
    assert ("StatefulSet", "splitserve-redis") in kinds
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    if name == "cross-node":
        assert {"splitserve-prefill", "splitserve-decode"} <= set(deployments)
        assert "splitserve-worker" not in deployments
        cfg = next(d for d in docs if d["kind"] == "ConfigMap")
        assert cfg["data"]["SPLITSERVE_KV_TRANSPORT"] == "grpc"
    else:
        pod = deployments["splitserve-worker"]["spec"]["template"]["spec"]
        assert {c["name"] for c in pod["containers"]} == {"prefill", "decode"}
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
        for c in pod["containers"]:
            assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    if name == "gpu":
        pod = deployments["splitserve-worker"]["spec"]["template"]["spec"]
        assert all(c["resources"]["limits"]["nvidia.com/gpu"] == 1 for c in pod["containers"])
        assert pod["nodeSelector"] and pod["tolerations"]
    if name in ("dev", "secure"):
        assert all(d["spec"]["replicas"] == 1 for d in deployments.values())


def test_tls_objects_are_well_formed(rendered):
    """secure: cert-manager makes the certificate every container mounts, TLS settings name its
    files, the processes check peers by a name it holds, and each probe calls the plaintext
    health-only port its own container serves (kubelet's gRPC probes cannot speak TLS)."""
    name, docs, _ = rendered
    if name != "secure":
        assert not any(d["kind"] in CERT_MANAGER_KINDS for d in docs)
        return
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    leaf = by["Certificate", "splitserve-tls"]["spec"]
    assert {"server auth", "client auth"} <= set(leaf["usages"])
    issuer = by["Issuer", leaf["issuerRef"]["name"]]["spec"]["ca"]["secretName"]
    assert (
        by["Certificate", "splitserve-ca"]["spec"]["isCA"]
        and by["Certificate", "splitserve-ca"]["spec"]["secretName"] == issuer
    )
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    assert config["SPLITSERVE_TLS_SERVER_NAME"] in leaf["dnsNames"] and "splitserve-router" in leaf["dnsNames"]
    health_ports = set()
    for d in (d for d in docs if d["kind"] == "Deployment"):
        pod = d["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert secrets["tls"] == leaf["secretName"], d["metadata"]["name"]
        for c in pod["containers"]:
            mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls")
            for key, file in (("CERT", "tls.crt"), ("KEY", "tls.key"), ("CA", "ca.crt")):
                assert config[f"SPLITSERVE_TLS_{key}"] == f"{mount}/{file}"
            env = {e["name"]: e.get("value") for e in c["env"]}
            port = int(env["SPLITSERVE_HEALTH_PORT"])
            assert port not in health_ports  # (one pod's containers share its network)
            health_ports.add(port)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"]["port"] == port, (c["name"], probe)
            if c["name"] == "router":
                tokens = env["SPLITSERVE_AUTH_TOKENS_FILE"]
                mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tokens")
                assert tokens.startswith(mount + "/") and secrets["tokens"].startswith("splitserve-tokens")
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith("splitserve-tokens"))
    from splitserve.service.tenants import parse

    assert parse(base64.b64decode(secret["data"]["tokens.json"]).decode(), "tokens.json")  # the router reads it


def test_objects_validate_against_kubernetes_schemas(rendered):
    _, docs, path = rendered
    core = [d for d in docs if d["kind"] not in KEDA_KINDS | CERT_MANAGER_KINDS]
    core_path = path.with_name("core.yaml")
    core_path.write_text(yaml.safe_dump_all(core))
    out = subprocess.run(
        [_tool("kubernetes-validate"), "--strict", "--kubernetes-version", K8S_VERSION, str(core_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" passed for resource ") == len(core), out.stdout


def test_keda_objects_are_well_formed(rendered):
    _, docs, _ = rendered
    names = {d["metadata"]["name"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    auths = {d["metadata"]["name"] for d in docs if d["kind"] == "TriggerAuthentication"}
    secrets_used = {
        r["name"] for d in docs if d["kind"] == "TriggerAuthentication" for r in d["spec"]["secretTargetRef"]
    }
    # every Secret named is one the overlay makes (with its hash suffix) or cert-manager makes; overlays
    # that bring their own Secrets name splitserve-redis as it is
    made = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    made |= {d["spec"]["secretName"] for d in docs if d["kind"] == "Certificate"}
    assert secrets_used <= made if made else secrets_used == {"splitserve-redis"}, (secrets_used, made)
    exported = {m.name for m in DecodeMetrics().registry.collect()}
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    scaled_on, streams = set(), set()
    for so in (d for d in docs if d["kind"] == "ScaledObject"):
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        target = so["spec"]["scaleTargetRef"]["name"]
        assert target in names
        containers = {c["name"] for c in deployments[target]["spec"]["template"]["spec"]["containers"]}
        types = {t["type"] for t in so["spec"]["triggers"]}
        # Prefill scales on the queue's backlog, decode on its running sequences.
        assert ("redis-streams" in types) == ("prefill" in containers), (target, types)
        assert ("prometheus" in types) == ("decode" in containers), (target, types)
        for t in so["spec"]["triggers"]:
            if t["type"] == "redis-streams":
                assert t["metadata"]["consumerGroup"] == "prefill"
                assert t["authenticationRef"]["name"] in auths
                streams.add(t["metadata"]["stream"])
                scaled_on.add("prefill")
            if t["type"] == "prometheus":
                metric = re.match(r"\w+\((\w+)\{", t["metadata"]["query"]).group(1)
                assert metric == "splitserve_num_requests_running" and metric in exported
                assert 'container="decode"' in t["metadata"]["query"] and float(t["metadata"]["threshold"]) > 0
                scaled_on.add("decode")
    assert scaled_on == {"prefill", "decode"}
    assert streams == set(Keys("splitserve").streams)  # every priority class's backlog counts


def test_every_process_exposes_metrics_and_sends_traces(rendered):
    _, docs, _ = rendered
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    assert config["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http")
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        pod = d["spec"]["template"]["spec"]
        ports = [p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])]
        assert len(ports) == len(set(ports)), d["metadata"]["name"]
        for c in pod["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            port = int(env["SPLITSERVE_METRICS_PORT"])
            assert port in [p["containerPort"] for p in c["ports"]], (d["metadata"]["name"], c["name"])
            assert f"k8s.container.name={c['name']}" in env["OTEL_RESOURCE_ATTRIBUTES"]


def test_checkov_reports_no_unsuppressed_failure(rendered):
    _, _, path = rendered
    out = subprocess.run(
        [_tool("checkov"), "-f", str(path), "--framework", "kubernetes", "--quiet", "--compact", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(out.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [(c["check_id"], c["resource"]) for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    passed = sum(r.get("summary", {}).get("passed", 0) for r in reports)
    assert failed == [], failed
    assert passed > 50  # the checks really ran


def test_checkov_dockerfile():
    out = subprocess.run(
        [
            _tool("checkov"),
            "-f",
            str(REPO / "deploy" / "docker" / "Dockerfile"),
            "--framework",
            "dockerfile",
            "--quiet",
            "--compact",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(out.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [c["check_id"] for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    assert failed == []
    assert sum(r.get("summary", {}).get("passed", 0) for r in reports) > 5


def _code_env_names() -> set[str]:
    names = {env_name(f.name) for f in __import__("dataclasses").fields(Settings)}
    return names | {"REDIS_URL"} | set(OTEL_ENV)


def _secret(docs, prefix: str, key: str) -> str:
    """The generated Secret `prefix`-HASH's key, decoded."""
    d = next(d for d in docs if d["kind"] == "Secret" and re.fullmatch(rf"{prefix}-[a-z0-9]+", d["metadata"]["name"]))
    return base64.b64decode(d["data"][key]).decode()


def test_the_secure_overlays_redis_takes_its_url_over_tls_only(tmp_path):
    """secure: Redis serves TLS alone with client certificates required, its ACL file's user is
    the one in the processes' rediss:// URL (password checked against the hash), the processes'
    Redis TLS files are the certificate they mount, and KEDA's scalers log in the same way. The
    rendered Redis command is run here, on Debian's redis-server, with this test's certificates."""
    tls_redis = shutil.which("redis-server", path="/usr/bin:/usr/local/bin")
    if tls_redis is None:
        pytest.skip("needs Debian's redis-server, built with TLS (apt-get install)")
    import redis

    from splitserve.service.redis_state import open_redis
    from splitserve.service.tls import make_local_ca

    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / "secure")], capture_output=True, text=True)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    redis_cert = by["Certificate", "splitserve-redis-tls"]["spec"]
    assert redis_cert["issuerRef"] == by["Certificate", "splitserve-tls"]["spec"]["issuerRef"]  # the stack's CA
    url = _secret(docs, "splitserve-redis-url", "url")
    assert url.startswith("rediss://") and url.split("@")[1].split(":")[0] in redis_cert["dnsNames"]
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    for key in ("CA", "CERT", "KEY"):
        assert config[f"SPLITSERVE_REDIS_TLS_{key}"] == config[f"SPLITSERVE_TLS_{key}"], key
    keda = {r["parameter"]: r for r in by["TriggerAuthentication", "splitserve-redis"]["spec"]["secretTargetRef"]}
    assert {"username", "password", "tls", "ca", "cert", "key"} <= set(keda)
    creds = {p: _secret(docs, "splitserve-redis", keda[p]["key"]) for p in ("username", "password", "tls")}
    assert creds["tls"] == "enable" and url.startswith(f"rediss://{creds['username']}:{creds['password']}@")

    server = by["StatefulSet", "splitserve-redis"]["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    files = make_local_ca(str(tmp_path / "pki"), hosts=["127.0.0.1"])
    acl = tmp_path / "users.acl"
    acl.write_text(_secret(docs, "splitserve-redis-acl", "users.acl"))
    local = {
        f"{mounts['tls']}/tls.crt": files.cert,
        f"{mounts['tls']}/tls.key": files.key,
        f"{mounts['tls']}/ca.crt": files.ca,
        f"{mounts['acl']}/users.acl": str(acl),
        "/data": str(tmp_path),
    }
    command = [local.get(a, a) for a in server["command"]]
    port = _free_port()
    command[command.index("--tls-port") + 1] = str(port)
    assert command[command.index("--port") + 1] == "0" and command[command.index("--tls-auth-clients") + 1] == "yes"
    proc = subprocess.Popen([tls_redis, *command[1:], "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)
    try:
        here = url.replace("@splitserve-redis:6379", f"@127.0.0.1:{port}")
        settings = Settings(
            redis_url=here, redis_cluster="off", redis_tls_ca=files.ca, redis_tls_cert=files.cert,
            redis_tls_key=files.key,
        )  # fmt: skip
        for _ in range(100):
            try:
                with open_redis(settings) as r:
                    assert r.ping() and r.acl_whoami() == creds["username"]
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "redis-server stopped"
                time.sleep(0.1)
        else:
            raise AssertionError("redis-server did not come up")
        no_cert = settings.replace(redis_tls_cert="", redis_tls_key="")
        with pytest.raises(redis.ConnectionError), open_redis(no_cert) as r:
            r.ping()  # a client without a certificate the CA signed is refused
        default_user = settings.replace(redis_url=f"rediss://default:{creds['password']}@127.0.0.1:{port}")
        with pytest.raises(redis.AuthenticationError), open_redis(default_user) as r:
            r.ping()  # the default user is off
    finally:
        proc.terminate()
        proc.wait(10)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_every_env_var_set_is_read_by_the_code(rendered):
    _, docs, _ = rendered
    known = _code_env_names()
    config = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    checked = 0
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            if not c["image"].rsplit("/", 1)[-1].startswith("splitserve"):
                continue  # third-party images (redis) read their own
            env = c.get("env", [])
            expanded = {m for e in env for m in re.findall(r"\$\((\w+)\)", e.get("value", ""))}
            for e in env:
                if e["name"] in expanded:
                    continue  # only feeds another variable's $(VAR)
                assert e["name"] in known, f"{c['name']} sets {e['name']}, which no code reads"
                checked += 1
            for src in c.get("envFrom", []):
                cm = config[src["configMapRef"]["name"]]
                for key in cm:
                    assert key in known, f"ConfigMap key {key} is read by no code"
                    checked += 1
    assert checked > 10


def test_settings_in_the_configmap_parse():
    docs = [
        d
        for d in yaml.safe_load_all(
            subprocess.run(
                ["kubectl", "kustomize", str(K8S / "overlays" / "dev")], capture_output=True, text=True
            ).stdout
        )
        if d
    ]
    cm = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    s = Settings.from_env(cm)
    assert s.drain_s < min(
        d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] for d in docs if d["kind"] == "Deployment"
    )
    # The router's grace covers its preStop wait, its drain and the 5 s it then gives calls to end.
    router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "splitserve-router")
    pod = router["spec"]["template"]["spec"]
    wait = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert wait[0] == "sleep" and float(wait[1]) + s.drain_s + 5 < pod["terminationGracePeriodSeconds"], wait


def test_yamllint_is_clean():
    out = subprocess.run(
        [_tool("yamllint"), "-s", "-c", str(REPO / ".yamllint"), str(REPO / "deploy")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_configuration_page_lists_every_setting_with_its_default_and_is_current():
    import dataclasses

    check = subprocess.run(
        [sys.executable, str(REPO / "docs" / "gen_configuration.py"), "--check"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    page = (REPO / "docs" / "configuration.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(SPLITSERVE_\w+)` \| `?([^`|]*)`? \|", page, re.M)}
    defaults = Settings()
    for f in dataclasses.fields(Settings):
        name = env_name(f.name)
        assert name in rows, f"{name} is not in docs/configuration.md"
        if f.name not in ("cache_dir",):  # a path that depends on the machine
            assert rows[name].strip() == (str(getattr(defaults, f.name)) or "(empty)"), (name, rows[name])


def _render_with_components(tmp_path, overlay: str, components: list[str]) -> list[dict]:
    """An overlay with optional components added, as a user's kustomization would."""
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(K8S / "overlays" / overlay, tmp_path)],
                "components": [os.path.relpath(K8S / "components" / c, tmp_path) for c in components],
            }
        )
    )
    out = subprocess.run(
        [shutil.which("kubectl"), "kustomize", "--load-restrictor=LoadRestrictionsNone", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("overlay", ["dev", "cross-node"])
def test_the_pod_monitor_scrapes_every_metrics_port_and_the_dashboard_queries_exported_metrics(tmp_path, overlay):
    from splitserve.observability.metrics import PrefillMetrics, RouterMetrics

    docs = _render_with_components(tmp_path, overlay, ["monitoring"])
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    selector = monitor["spec"]["selector"]["matchLabels"]
    for d in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and "redis" not in d["metadata"]["name"]):
        pod = d["spec"]["template"]
        assert selector.items() <= pod["metadata"]["labels"].items(), d["metadata"]["name"]
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", ()) if "metrics" in p["name"]}
        assert ports and ports <= scraped, (d["metadata"]["name"], ports)
    board = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("dashboard"))
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(board["data"]["splitserve.json"])
    queried = {
        re.sub(r"_(bucket|sum|count|total)$", "", m)
        for p in dashboard["panels"]
        for t in p["targets"]
        for m in re.findall(r"splitserve_\w+", t["expr"])
    }
    exported = {m.name for cls in (RouterMetrics, DecodeMetrics, PrefillMetrics) for m in cls().registry.collect()}
    assert queried and queried <= exported, queried - exported
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for what in ("first token", "inter-token", "end-to-end", "queue", "refusals", "kv cache", "running", "handoff"):
        assert what in titles, what


def test_the_gateway_routes_point_at_the_routers_ports():
    docs = [d for d in yaml.safe_load_all((K8S / "components" / "gateway" / "routes.yaml").read_text()) if d]
    router = [d for d in yaml.safe_load_all((K8S / "base" / "router.yaml").read_text()) if d]
    service = next(d for d in router if d["kind"] == "Service" and d["metadata"]["name"] == "splitserve-router")
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    kinds = {d["kind"]: d for d in docs}
    grpc_ref = kinds["GRPCRoute"]["spec"]["rules"][0]["backendRefs"][0]
    http_ref = kinds["HTTPRoute"]["spec"]["rules"][0]["backendRefs"][0]
    assert grpc_ref["name"] == http_ref["name"] == "splitserve-router"
    assert ports[grpc_ref["port"]]["appProtocol"] == "grpc" and ports[http_ref["port"]]["appProtocol"] == "http"
    assert kinds["GRPCRoute"]["spec"]["rules"][0]["matches"][0]["method"]["service"] == "splitserve.v1.Generation"
