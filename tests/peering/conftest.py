import importlib.util

import pytest

from tests.peering.cluster import make_tls, start_cluster

collect_ignore_glob = [] if importlib.util.find_spec("nixl_cu13") else ["test_*.py"]  # kvxfer[peering] not installed


@pytest.fixture(scope="session")
def tls(tmp_path_factory):
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def cluster(tls):
    """Start daemons that peer with each other: ``cluster(["a", "b"], transport="tcp", ...)``."""
    started = []

    def make(names, transport="shm", **kwargs):
        daemons = start_cluster(names, tls, transport, **kwargs)
        started.extend(daemons.values())
        return daemons

    yield make
    for d in started:
        d.cleanup()
