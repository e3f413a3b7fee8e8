"""The committed generated code (kvxfer/v1) is exactly what the proto generates."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

GENERATED = ["kvxfer_pb2.py", "kvxfer_pb2.pyi", "kvxfer_pb2_grpc.py"]


def test_generated_code_is_current(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    str(ROOT / "protos/kvxfer/v1/kvxfer.proto")], check=True)
    for name in GENERATED:
        fresh = (tmp_path / "kvxfer/v1" / name).read_text()
        committed = (ROOT / "kvxfer/v1" / name).read_text()
        assert fresh == committed, f"kvxfer/v1/{name} is stale: run `make proto`"


def test_generated_imports_follow_the_package():
    grpc_code = Path(ROOT / "kvxfer/v1/kvxfer_pb2_grpc.py").read_text()
    assert "from kvxfer.v1 import kvxfer_pb2" in grpc_code  # proto path matches the package; never rewritten
