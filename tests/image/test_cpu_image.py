"""The CPU image the chart ships, run as the chart runs it (issue 29): as its non-root user, with a
read-only root filesystem, the config mounted read-only and the socket directory shared with the host,
where a client checks health and offloads and restores a block bit-exact through it. The image is
built once (``conftest.image``).
"""

from __future__ import annotations

import os
import time

import torch

from kvxfer import Client
from kvxfer.core.records import Outcome
from tests.image.conftest import IMAGE, podman

CONFIG = """socket: /run/kvxfer/kvxfer.sock
socket_mode: "0666"
metrics_listen: ""
pools:
  - id: rank0
    device: cpu
    spec: {num_layers: 4, num_blocks: 64, block_size: 16, num_kv_heads: 2, head_size: 32, dtype: float16}
    host_capacity_mib: 4
"""


def test_the_cpu_image_serves_as_non_root_on_a_read_only_root(image):
    conf, work = image
    config, run = work / "config", work / "run"
    config.mkdir()
    run.mkdir()
    run.chmod(0o777)  # the container's user (uid 1000) makes the socket here
    (config / "kvxfer.yaml").write_text(CONFIG)
    name = f"kvxfer-ci-{os.getpid()}"
    podman(conf, "run", "-d", "--name", name, "--read-only", "--tmpfs", "/var/cache/kvxfer",
           f"--volume={config}:/etc/kvxfer/config:ro", f"--volume={run}:/run/kvxfer", IMAGE)
    try:
        deadline = time.monotonic() + 60
        while not (run / "kvxfer.sock").exists():
            assert time.monotonic() < deadline, podman(conf, "logs", name, check=False).stderr[-3000:]
            time.sleep(0.2)
        assert podman(conf, "exec", name, "id", "-u").stdout.strip() == "1000"
        assert podman(conf, "exec", name, "touch", "/x", check=False).returncode != 0  # read-only root
        with Client(f"unix:{run / 'kvxfer.sock'}", timeout=30) as client:
            assert client.health(timeout=10) == "SERVING"
            pool = client.map_pool("rank0")
            span = pool.layout.block_bytes
            data = torch.randint(0, 256, (span,), dtype=torch.uint8)
            pool.storage[span:2 * span] = data
            assert client.offload([(1, b"image")], pool_id="rank0").outcomes == [Outcome.DONE]
            assert client.restore([(b"image", 5)], pool_id="rank0").outcomes == [Outcome.DONE]
            assert torch.equal(pool.storage[5 * span:6 * span], data)
        assert '"level": "error"' not in podman(conf, "logs", name).stderr
    finally:
        podman(conf, "rm", "-f", "--volumes", name, check=False)  # and the image's VOLUMEs it made
