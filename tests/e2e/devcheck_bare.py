"""The device check's stages the simulator can run, in a bare interpreter: ``python -m tests.e2e.devcheck_bare
WHEELS REGION OUT``. Bootstraps exactly as ``kvxfer devcheck`` does (the carried wheels unpacked first on the
path, no pip), prints what it loaded from where as its first line, then runs the stages on the simulated GPUs
of REGION and prints the report's path."""

import json
import sys
from pathlib import Path

from kvxfer.devcheck import bootstrap

if __name__ == "__main__":
    wheels, region, out = sys.argv[1:4]
    packages = bootstrap.unpack(Path(wheels))
    print("[devcheck] loaded: " + "; ".join(bootstrap.loaded()), flush=True)
    from kvxfer.devcheck import stages
    from kvxfer.devcheck.report import run_stages
    from kvxfer.memory import cuda_driver
    from kvxfer.transfer import staging
    from tests.cudasim.library import CudaSim

    sim = CudaSim(region)
    cuda_driver.load_library = lambda name=cuda_driver.LIBRARY: sim
    staging.STAGING_BUFFER_BYTES = 8 * 1024
    chosen = [s for s in stages.STAGES if s[0] in ("daemon_over_grpc", "staging_on_the_gpu")]
    small = {"num_layers": 2, "block_size": 4, "num_kv_heads": 2, "head_size": 16}
    status = run_stages(out, chosen, prepared={"packages": packages, "copy_loop": "test"}, settings={
        "daemon_command": [sys.executable, "-m", "tests.cudasim.daemon", region], "daemon_blocks": 16,
        "daemon_host_mib": 1, "latency_calls": 10, "daemon_spec": small, "staging_blocks": 6,
        "staging_spec": {**small, "num_layers": 4}})
    print(json.dumps({"status": status, "report": str(Path(out) / "devcheck.json")}))
