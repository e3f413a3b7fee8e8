import importlib.util
import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import torch

# Triton kernels run on the CPU only under its interpreter; this must be set before
# they are imported. On a GPU host the real kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent

# tests/vllm and tests/sglang need their engines, each installed only into its own environment
# (make test-vllm, make test-sglang); tests/engine needs vLLM's CPU build (make test-engine).
collect_ignore = [name for name in ("vllm", "sglang") if not importlib.util.find_spec(name)]
collect_ignore += ["engine"] if not importlib.util.find_spec("vllm") else []


@pytest.fixture
def shm_dir():
    """A private directory on /dev/shm, removed after the test; asserts nothing was left in it."""
    path = Path("/dev/shm") / f"kvxfer-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def python_env() -> dict:
    """Environment for child Python processes: the project importable, output unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


PYTHON = sys.executable


@pytest.fixture
def cuda_sim(tmp_path, monkeypatch):
    """This process's CUDA driver is the simulator (tests/cudasim) over a fresh two-GPU region."""
    from kvxfer.memory import cuda_driver
    from tests.cudasim.library import CudaSim
    from tests.cudasim.region import Region

    sim = CudaSim(Region.create(tmp_path / "gpus"))
    monkeypatch.setattr(cuda_driver, "load_library", lambda name=cuda_driver.LIBRARY: sim)
    monkeypatch.setattr(cuda_driver, "_DRIVERS", {})
    yield sim
    sim.dma.set()
