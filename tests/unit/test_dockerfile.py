"""The images' parts agree (issue 50: the CUDA image paired a CUDA 12.8 torch with NIXL's CUDA 13 wheel)."""

import re
import tomllib

from tests.conftest import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _stage(name: str) -> str:
    start = DOCKERFILE.index(f" AS {name}\n")
    end = DOCKERFILE.find("\nFROM ", start)
    return DOCKERFILE[DOCKERFILE.rindex("\nFROM ", 0, start):end if end > 0 else None]


def test_the_cuda_image_has_one_cuda_major_for_its_base_torch_and_nixl():
    stage = _stage("base-cuda")
    base = re.search(r"FROM nvidia/cuda:(\d+)\.(\d+)", stage)
    torch_cuda = re.search(r"TORCH_INDEX_URL=\S+/whl/cu(\d+)", stage).group(1)
    nixl = re.search(r"NIXL_WHEEL=nixl-cu(\d+)", stage).group(1)
    assert base.group(1) == torch_cuda[:-1] == nixl  # cu128: CUDA 12.8
    assert int(torch_cuda[-1]) <= int(base.group(2))  # torch's CUDA is no newer than the base's


def test_the_cpu_image_takes_the_nixl_wheel_and_version_the_package_pins():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["peering"]
    (pin,) = [p for p in extra if p.startswith("nixl")]
    wheel, version = pin.split("==")
    assert re.search(rf"NIXL_WHEEL={re.escape(wheel)}\b", _stage("base-cpu"))
    assert f"ARG NIXL_VERSION={version}\n" in _stage("kvxfer")
    assert '"${NIXL_WHEEL}==${NIXL_VERSION}"' in _stage("kvxfer")
