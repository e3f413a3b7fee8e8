"""``kvxfer serve`` on the simulated GPUs: ``python -m tests.cudasim.daemon REGION serve ...``.

The daemon process's CUDA driver is a ``CudaSim`` over the region the test (the engine
side) maps too; nothing else differs from a real daemon.
"""

import sys

from kvxfer.memory import cuda_driver
from tests.cudasim.library import CudaSim

if __name__ == "__main__":
    sim = CudaSim(sys.argv[1])
    cuda_driver.load_library = lambda name=cuda_driver.LIBRARY: sim
    from service.program import main

    sys.exit(main(sys.argv[2:]))
