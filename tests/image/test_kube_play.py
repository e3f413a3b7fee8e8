"""The pod the chart renders, run (issue 50): ``podman kube play`` of the rendered ConfigMap and Deployment,
with the CPU image built from the Dockerfile as the sidecar and, as the engine, a stand-in in the same image
that uses the client: it maps the daemon's pool through the shared socket, offloads and restores a block and
checks it bit-exact, then answers the engine probes' ``GET /health``.

What podman cannot take as Kubernetes does is changed, and only that: the native sidecar (an init container
with ``restartPolicy: Always``, which podman would wait on to exit) becomes the pod's first container, and the
engine container's image and command become the stand-in's. Everything else (the config, volumes, the socket
directory and ``/dev/shm``, users, the read-only root, probes, resources) is the chart's.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from tests.image.conftest import IMAGE, podman

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a test dependency")

STAND_IN = r'''
import http.server, os, sys, time
import torch
from kvxfer import Client
from kvxfer.core.records import Outcome

socket = os.environ["KVXFER_TARGET"]
deadline = time.monotonic() + 120
while not os.path.exists(socket.removeprefix("unix:")):
    if time.monotonic() > deadline:
        sys.exit("no daemon socket")
    time.sleep(0.2)
with Client(socket, timeout=30) as client:
    pool = client.map_pool("rank0")
    span = pool.layout.block_bytes
    data = torch.randint(0, 256, (span,), dtype=torch.uint8)
    pool.storage[span:2 * span] = data
    assert client.offload([(1, b"kube-play")], pool_id="rank0").outcomes == [Outcome.DONE]
    assert client.restore([(b"kube-play", 5)], pool_id="rank0").outcomes == [Outcome.DONE]
    assert torch.equal(pool.storage[5 * span:6 * span], data)
print("STAND-IN: offloaded and restored a block bit-exact through the shared socket", flush=True)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer(("0.0.0.0", int(os.environ["PORT"])), Health).serve_forever()
'''


class _Literal(yaml.SafeDumper):
    """Multi-line strings as literal blocks: Go's YAML refuses a quoted scalar over 1,024 characters in a list."""


_Literal.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def _rendered() -> tuple[dict, dict]:
    from tests.e2e.test_helm import CHART

    values = {"gpu": {"mode": "none"}, "engine": {"device": "cpu", "service": False, "modelCache": {"mountPath": ""}},
              "kvxfer": {"image": {"repository": IMAGE.split(":")[0], "tag": "ci", "variant": "cpu"},
                         "config": {"metrics_listen": "127.0.0.1:9470"}},
              "monitoring": {"service": False, "dashboard": {"enabled": False}}}
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="play", namespace="default")
    objects = [doc for name, text in sorted(files.items()) if name.endswith(".yaml")
               for doc in yaml.safe_load_all(text) if doc]
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    return config_map, deployment


def _for_podman(deployment: dict) -> tuple[dict, str, str]:
    pod = deployment["spec"]["template"]["spec"]
    (sidecar,) = pod.pop("initContainers")
    assert sidecar.pop("restartPolicy") == "Always" and sidecar["image"] == IMAGE  # the chart's native sidecar
    (engine,) = pod["containers"]
    port = engine["ports"][0]["containerPort"]
    socket = next(arg for arg in engine["args"] if "socket" in arg)  # the connector's config names the socket
    engine.update(image=IMAGE, command=["python", "-c", STAND_IN.strip()])
    engine.pop("args")
    engine["env"] = [*engine.get("env", []), {"name": "PORT", "value": str(port)},
                     {"name": "KVXFER_TARGET", "value": "unix:" + json.loads(socket)["kv_connector_extra_config"]["socket"]}]
    pod["containers"] = [sidecar, engine]
    return deployment, sidecar["name"], engine["name"]


def _volumes(deployment: dict) -> list[str]:
    """The volumes ``kube play`` makes for the pod: one per emptyDir, named as it is, and one per ConfigMap."""
    return [v["configMap"]["name"] if "configMap" in v else v["name"]
            for v in deployment["spec"]["template"]["spec"]["volumes"] if "configMap" in v or "emptyDir" in v]


def test_the_rendered_pod_starts_its_probes_pass_and_the_engine_offloads_through_the_socket(image, tmp_path):
    conf, _ = image
    config_map, deployment = _rendered()
    deployment, sidecar, engine = _for_podman(deployment)
    kube = tmp_path / "pod.yaml"
    kube.write_text(yaml.dump_all([config_map, deployment], Dumper=_Literal))
    volumes = _volumes(deployment)
    podman(conf, "volume", "rm", "--force", *volumes)  # kube play would reuse one an earlier run left (--force: if any)
    podman(conf, "kube", "play", str(kube), timeout=300)
    try:
        pods = json.loads(podman(conf, "pod", "ps", "--format", "json").stdout)
        (pod,) = [p for p in pods if p["Name"].startswith(deployment["metadata"]["name"])]
        containers = [name for c in json.loads(podman(conf, "ps", "--all", "--pod", "--format", "json").stdout)
                      if c.get("PodName") == pod["Name"] for name in c["Names"]]
        by_role = {role: next(n for n in containers if n.endswith("-" + role)) for role in (sidecar, engine)}
        deadline = time.monotonic() + 240
        while "STAND-IN: offloaded" not in podman(conf, "logs", by_role[engine], check=False).stdout:
            state = podman(conf, "inspect", by_role[engine], "--format", "{{.State.Status}}", check=False).stdout
            logs = podman(conf, "logs", by_role[engine], check=False)
            assert time.monotonic() < deadline and "exited" not in state, (state, logs.stdout[-2000:],
                                                                        logs.stderr[-3000:])
            time.sleep(1)
        # The probes, as the chart wrote them: the sidecar's exec probe and the engine's GET /health.
        probe = deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["exec"]["command"]
        assert podman(conf, "exec", by_role[sidecar], *probe).returncode == 0
        path = deployment["spec"]["template"]["spec"]["containers"][1]["readinessProbe"]["httpGet"]["path"]
        port = deployment["spec"]["template"]["spec"]["containers"][1]["ports"][0]["containerPort"]
        get = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}{path}').status)"
        assert podman(conf, "exec", by_role[engine], "python", "-c", get).stdout.strip() == "200"
        assert podman(conf, "exec", by_role[sidecar], "id", "-u").stdout.strip() == "1000"
        assert podman(conf, "exec", by_role[sidecar], "touch", "/x", check=False).returncode != 0  # read-only root
        assert '"level": "error"' not in podman(conf, "logs", by_role[sidecar]).stderr
    finally:
        podman(conf, "kube", "down", str(kube), check=False, timeout=120)
        podman(conf, "volume", "rm", "--force", *volumes, check=False)  # (podman 4.3's kube down keeps them)
