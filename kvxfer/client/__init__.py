"""The engine-side client of the daemon: ``from kvxfer.client import Client``.

``daemon_client`` holds the calls, ``results`` what they return, ``channel`` the gRPC channel and
its deadline clock, ``lane_client`` the local lane beside gRPC, ``fdpass`` the descriptor socket and
``wire`` the records' protobuf form (which the daemon reads the same way).

The engine side's vocabulary is exported here too: what an engine integration needs besides the
client to describe its pool (``kvxfer.integrations`` imports nothing else of the library but the
core's records, errors and validation).
"""

from kvxfer.client.daemon_client import Client
from kvxfer.client.results import SUCCESS, BlockFailures, FinishedJobs, PendingJobs
from kvxfer.events.event_records import EngineBlocks, ExtraKeys, KeyFormat
from kvxfer.geometry.layout import Axis, KVSpec, Layout, PoolLayout, dtype_name
from kvxfer.geometry.sharding import Sharding
from kvxfer.memory.ipc_event import CudaEvent, event_handle
from kvxfer.memory.pool import PoolHandle
from kvxfer.memory.shm import create_sealed, map_fd

__all__ = ["Axis", "BlockFailures", "Client", "CudaEvent", "EngineBlocks", "ExtraKeys", "FinishedJobs", "KVSpec",
           "KeyFormat", "Layout", "PendingJobs", "PoolHandle", "PoolLayout", "SUCCESS", "Sharding", "create_sealed",
           "dtype_name", "event_handle", "map_fd"]
