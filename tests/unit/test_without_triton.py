"""Triton is optional where it is not used (issue 50): the CPU daemon, the client, the engine backends'
CPU paths and the store core run with ``triton`` absent (the CPU image has none); only a GPU pool's copy
engine loads the kernels (``kvxfer.transfer.gpu_kernels``)."""

import subprocess

from tests.conftest import PYTHON, ROOT, python_env

WITHOUT_TRITON = """
import sys


class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton' (hidden by the test)")


sys.meta_path.insert(0, NoTriton())
import kvxfer.client, kvxfer.integrations.sglang, service.server  # noqa: E401,F401
from service import program as cli

code = cli.main(["bench", "store", "--spans-kib", "16", "--batch", "8", "--layouts", "BLHNC,LBHNC",
                 "--pool-mib", "4", "--min-mib", "1", "--reps", "1"])
print("triton loaded:", "triton" in sys.modules, "exit:", code)
"""


def test_the_cpu_paths_run_without_triton():
    out = subprocess.run([PYTHON, "-c", WITHOUT_TRITON], env=python_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "triton loaded: False exit: 0"
