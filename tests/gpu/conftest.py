from pathlib import Path

import pytest
import torch

NEEDS_GPU = "needs a CUDA device: run `kvxfer devcheck` (make devcheck) on a GPU machine"
HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    """Every test in this folder is a GPU test: marked, and skipped (saying why) where no GPU is."""
    for item in items:
        if HERE not in Path(item.path).parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason=NEEDS_GPU))
