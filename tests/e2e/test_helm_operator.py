"""The chart as an operator meets it (issue 50): the engine's Service, probes, model volume and arguments,
the metrics port, and the monitoring objects that need the Prometheus Operator. Rendered and linted with
Helm's own SDK, as in ``test_helm.py``."""

import json

import pytest
import yaml

from tests.e2e.test_helm import CASES, by_kind, pod_of, render, rendered_config


def test_a_cpu_vllm_engine_is_not_told_a_layout_its_backend_refuses():
    """Issue 50: the chart set VLLM_KV_CACHE_LAYOUT=BLHNC for every vLLM engine; vLLM's CPU backend accepts
    only LBHNC (its resolver raised ValueError). A GPU engine still gets BLHNC."""
    cpu = pod_of(render(CASES["CPU engine, no GPU"]))["containers"][0]
    assert "VLLM_KV_CACHE_LAYOUT" not in {e["name"] for e in cpu.get("env", [])}
    gpu = pod_of(render(CASES["GPU, device plugin"]))["containers"][0]
    assert {"name": "VLLM_KV_CACHE_LAYOUT", "value": "BLHNC"} in gpu["env"]


@pytest.mark.parametrize("listen", ["[::]:9411", "0.0.0.0:9412"])
def test_the_metrics_port_is_the_one_after_the_last_colon(listen):
    """Issue 50: ``metrics_listen: "[::]:9400"`` rendered ``containerPort: 0`` and a Service port 0."""
    objects = render({"kvxfer": {"config": {"metrics_listen": listen}}})
    port = int(listen.rsplit(":", 1)[1])
    sidecar = pod_of(objects)["initContainers"][0]
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in sidecar["ports"]
    services = [s for s in by_kind(objects, "Service") if any(p.get("name") == "metrics" for p in s["spec"]["ports"])]
    assert services and all(p["port"] == port for s in services for p in s["spec"]["ports"] if p["name"] == "metrics")


def test_the_default_metrics_port_is_not_dcgm_exporter_s():
    """Issue 50: 9400 is NVIDIA dcgm-exporter's port, which runs on every GPU node (host network)."""
    from service import config as service_config

    for listen in (service_config.Config().metrics_listen, rendered_config(render({}))["metrics_listen"]):
        assert int(listen.rsplit(":", 1)[1]) not in (9400, 9100, 9090, 8000, 8080)  # dcgm, node, Prometheus, engines


def test_the_engine_gets_a_service_probes_and_numeric_arguments():
    """Issue 50: no Service for the engine's port, no engine probes, ``--set engine.args={--tensor-parallel-size,2}``
    refused ("got number"), and a ClusterIP events Service that reached one publisher at random."""
    objects = render({"engine": {"args": ["--tensor-parallel-size", 2, "--gpu-memory-utilization", 0.85]},
                      "kvxfer": {"events": {"enabled": True}}})
    engine = pod_of(objects)["containers"][0]
    assert engine["args"][-4:] == ["--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.85"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    services = {s["metadata"]["name"]: s["spec"] for s in by_kind(objects, "Service")}
    assert services["demo-kvxfer-engine"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http",
                                                      "protocol": "TCP"}]
    assert services["demo-kvxfer-kv-events"]["clusterIP"] == "None"
    sidecar_only = render({"engine": {"enabled": False}})
    assert "demo-kvxfer-engine" not in {s["metadata"]["name"] for s in by_kind(sidecar_only, "Service")}


def test_the_engine_keeps_its_model_on_a_volume():
    """Issue 50: no model cache volume: every restarted engine container downloaded its model again."""
    pod = pod_of(render({}))
    engine = pod["containers"][0]
    assert {"name": "HF_HOME", "value": "/models"} in engine["env"]
    assert {"name": "model-cache", "mountPath": "/models"} in engine["volumeMounts"]
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "64Gi"}} in pod["volumes"]
    claim = pod_of(render({"engine": {"modelCache": {"volume": {"persistentVolumeClaim": {"claimName": "m"}}}}}))
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "m"}} in claim["volumes"]
    none = pod_of(render({"engine": {"modelCache": {"mountPath": ""}}}))
    assert "model-cache" not in {v["name"] for v in none["volumes"]}


def test_servicemonitor_and_prometheusrule_wait_for_the_operator_s_api():
    """Issue 50: rendered by default with no ``.Capabilities`` check, they failed the install on a cluster without
    the Prometheus Operator. Here (no cluster: the API is not listed) they are left out; the dashboard is not."""
    kinds = {o["kind"] for o in render({})}
    assert not kinds & {"ServiceMonitor", "PrometheusRule"} and "Deployment" in kinds
    assert any(o["metadata"]["name"].endswith("-dashboard") for o in by_kind(render({}), "ConfigMap"))
    assumed = {o["kind"] for o in render({"monitoring": {"assumeOperator": True}})}
    assert {"ServiceMonitor", "PrometheusRule"} <= assumed


def test_the_schema_names_exactly_the_daemons_config_keys():
    from service import chart_schema

    assert chart_schema.main(["--check"]) == 0, "values.schema.json is stale: make chart-schema"
    config = json.loads(chart_schema.SCHEMA.read_text())["properties"]["kvxfer"]["properties"]["config"]
    keys = chart_schema.daemon_keys()
    assert set(config["properties"]) == set(keys) and config["additionalProperties"] is False
    for section, fields in keys.items():
        if fields is not None and "not" not in config["properties"][section]:
            assert set(config["properties"][section]["properties"]) == fields, section


@pytest.mark.parametrize("case", ["CPU engine, no GPU", "GPU, device plugin", "SGLang engine"])
def test_the_sidecars_memory_is_derived_from_what_the_daemon_will_hold(case, tmp_path):
    """Issue 50: the offload tier (registered_host_capacity_mib, per registering rank) did not move the sidecar's
    memory limit; 64 GiB of it passed --check on a 20 GiB host. The derived request and limit are what the daemon's
    own memory check counts for the rendered config, plus the process."""
    from service import config as service_config, preflight

    values = {**CASES[case]}
    values["kvxfer"] = {**values.get("kvxfer", {}), "registeredPools": 4,
                        "config": {**values.get("kvxfer", {}).get("config", {}),
                                   "registered_host_capacity_mib": 8192}}
    objects = render(values)
    config = rendered_config(objects)
    assert config["registered_ranks"] == 4
    config.update(socket=str(tmp_path / "k.sock"), socket_group="")
    config = {k: v for k, v in config.items() if k not in ("tls_cert", "tls_key", "token_file", "listen")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    need = preflight.memory_need(service_config.load(str(tmp_path / "c.yaml"), env={}))
    assert need.registered == 4 * 8192 << 20
    resources = pod_of(objects)["initContainers"][0]["resources"]
    limit = int(resources["limits"]["memory"].removesuffix("Mi"))
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert 0 <= limit - (1536 + (need.total - need.staging) / 2**20) < len(config["pools"]) + 1  # MiB rounded up


def test_memory_given_for_the_sidecar_is_kept():
    given = {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "90Gi"}}
    resources = pod_of(render({"kvxfer": {"resources": given}}))["initContainers"][0]["resources"]
    assert resources == given


def test_peers_get_stable_names_dns_addresses_and_one_certificate():
    """Issue 50: peering through the chart could not work: peer names defaulted to random pod names, no Service
    exposed the TLS port, and peers were addressed by pod IPs that change."""
    from tests.e2e.test_helm import PEERING

    objects = render(CASES["peering, certificates by cert-manager"])
    (workload,) = by_kind(objects, "StatefulSet")
    assert not by_kind(objects, "Deployment") and workload["spec"]["replicas"] == 3
    (headless,) = [s for s in by_kind(objects, "Service") if s["metadata"]["name"] == workload["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    sidecar = pod_of(objects)["initContainers"][0]
    (port,) = [p for p in sidecar["ports"] if p["name"] == headless["spec"]["ports"][0]["targetPort"]]
    assert port["containerPort"] == headless["spec"]["ports"][0]["port"] == 7070
    pods = [f"demo-kvxfer-{i}" for i in range(3)]
    peers = rendered_config(objects)["peering"]["peers"]
    assert [(p["name"], p["address"], p.get("server_name")) for p in peers] == [
        *((pod, f"{pod}.demo-kvxfer-peers.serving.svc:7070", pod) for pod in pods), ("decode-0", "10.0.0.7:7070", None)]
    (certificate,) = by_kind(objects, "Certificate")
    assert set(certificate["spec"]["dnsNames"]) == {*pods, *(f"{p}.demo-kvxfer-peers.serving.svc" for p in pods)}
    assert set(certificate["spec"]["usages"]) == {"server auth", "client auth"}
    tls = [v for v in pod_of(objects)["volumes"] if v.get("secret", {}).get("secretName") == "demo-kvxfer-peers-tls"]
    assert tls and not [s for s in by_kind(objects, "Secret") if s["type"] == "kubernetes.io/tls"]
    plain = render({"kvxfer": PEERING})  # a certificate brought inline: no Certificate, still a StatefulSet
    assert by_kind(plain, "StatefulSet") and not by_kind(plain, "Certificate")
    assert by_kind(render({}), "Deployment") and not by_kind(render({}), "StatefulSet")


def test_every_replica_loads_the_shared_peer_list_and_skips_itself(tmp_path):
    import subprocess

    from service import config as service_config

    config = rendered_config(render(CASES["peering, certificates by cert-manager"]))
    for name in ("tls_cert", "tls_key", "token_file"):
        config[name] = str(tmp_path / name)
    (tmp_path / "token_file").write_text("t0ken\n")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", config["tls_key"], "-out", config["tls_cert"], "-days", "1", "-subj", "/CN=demo-kvxfer",
                    "-addext", "subjectAltName=DNS:demo-kvxfer-0,DNS:demo-kvxfer-1,DNS:demo-kvxfer-2"],
                   check=True, capture_output=True)
    for peer in config["peering"]["peers"]:
        peer.update(tls_ca=config["tls_cert"], token_file=config["token_file"])
    config["peering"]["tls_client_ca"] = config["tls_cert"]
    for pod in range(3):  # the pod's name is its hostname: given here, as each replica would find it
        config["peering"]["name"] = f"demo-kvxfer-{pod}"
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({**config, "socket": str(tmp_path / "k.sock"),
                                                         "socket_group": ""}))
        peers = service_config.load(str(tmp_path / "c.yaml"), env={}).peering.peers
        assert [p.name for p in peers] == [f"demo-kvxfer-{i}" for i in range(3) if i != pod] + ["decode-0"]
