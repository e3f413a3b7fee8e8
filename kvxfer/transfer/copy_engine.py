"""The copy-engine interface: runs in, a completion handle out.

An engine moves whole blocks between a pool and a host tier. It decides nothing:
which blocks, which slots and what to do on failure are the caller's business.
A CPU engine completes inside ``submit``; a CUDA engine enqueues on a stream per
direction and its handle waits on an event, so callers always go through the handle.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvxfer.core.errors import DeadlineExceeded, Internal, KvxferError


class Direction(enum.Enum):
    TO_HOST = "pool->host"  # offload
    TO_POOL = "host->pool"  # restore


@dataclass(frozen=True)
class CopyBatch:
    """Copy pool block ``blocks[i]`` to or from host slot ``slots[i]``, for every i."""

    direction: Direction
    blocks: list[int]
    slots: Sequence[int]
    deadline: float | None = None  # time.monotonic(): the job's; a copy still running LANDING_S after it is late

    def __post_init__(self) -> None:
        if len(self.blocks) != len(self.slots):
            raise ValueError("a copy batch pairs each block with one slot")


LANDING_S = 0.5  # how long past its job's deadline a copy may still land before it is late (and its stream retired)


class LateCopies(DeadlineExceeded):
    """Copies missed their deadline and may still land (DMA cannot be recalled). ``slots``: the tier
    slots they touch, which must not be reused, and ``handles``: theirs, until ``CopyEngine.
    quarantine`` says they landed."""

    def __init__(self, message: str, slots: list[int], handles: list[CopyHandle]) -> None:
        super().__init__(message)
        self.slots, self.handles = slots, handles


class CopyHandle(ABC):
    """Completion of one submitted batch."""

    #: Set when the copy missed its deadline and may still be running.
    late: bool = False

    @abstractmethod
    def wait(self) -> list[int] | None:
        """Block until the copy finished; raise the copy's error if it failed.

        Returns each block's checksum as copied where the engine hashes while copying
        (``CopyEngine.hashes_copies``), else None."""

    def settle(self) -> None:
        """Block until the copy finished, whatever its outcome (cleanup after another error)."""
        try:
            self.wait()
        except KvxferError:
            pass  # the first error is the one reported; this copy's outcome no longer matters


class CompletedHandle(CopyHandle):
    """A handle for work that finished inside ``submit``."""

    def __init__(self, error: BaseException | None = None, checksums: list[int] | None = None) -> None:
        self._error = error
        self._checksums = checksums

    def wait(self) -> list[int] | None:
        if self._error is not None:
            raise self._error
        return self._checksums


class CopyEngine(ABC):
    """Moves blocks between one pool and one host tier."""

    @abstractmethod
    def submit(self, batch: CopyBatch) -> CopyHandle:
        """Start copying ``batch``; the bytes are only valid once the handle completes."""

    @abstractmethod
    def pool_checksums(self, blocks: list[int]) -> list[int]:
        """The block checksum (kvxfer.geometry.block_checksum) of each pool block as it is now."""

    @property
    @abstractmethod
    def descriptors_per_block(self) -> int:
        """Contiguous byte runs one block costs (1 for block-major layouts)."""

    @property
    def overlaps(self) -> bool:
        """Whether ``submit`` returns before the copy is done (a DMA engine): the pipeline then
        keeps a second chunk in flight while it hashes the first."""
        return False

    @property
    def hashes_copies(self) -> bool:
        """Whether a handle's ``wait`` returns the checksum of each block as copied: of the
        tier copy for an offload; for a restore, of the block as it landed in the pool (one
        span) or of the tier copy it came from. The pipeline then makes no pass of its own."""
        return False

    @property
    def hash_threads(self) -> int:
        """Host threads the pipeline may use to hash tier copies this engine did not hash itself."""
        return 1

    @property
    def hashes_pool(self) -> bool:
        """Whether ``pool_checksums`` reads the pool cheaply (from this process's mapping)."""
        return True

    def await_ready(self, event: bytes, deadline: float | None, cancelled: Callable[[], bool] | None = None) -> bool:
        """Wait on this thread until the engine's ready event (a CUDA IPC event handle) has completed:
        True, or False once ``deadline`` (time.monotonic()) passed or ``cancelled`` said so first. No copy
        of the batch is submitted before it returns True. CUDA engines only."""
        raise Internal(f"a CUDA event handle reached the {type(self).__name__}")

    def describe(self) -> str:
        """What moves the bytes, for the start-up log."""
        return type(self).__name__

    def quarantine(self, handles: list[CopyHandle], release: Callable[[], None], restore: bool) -> None:
        """Call ``release`` once every one of these late copies has landed. Engines whose copies
        finish inside ``submit`` never have late copies."""
        release()

    def reap(self) -> int:
        """Release what landed late copies held; returns how many are still late."""
        return 0

    def close(self) -> None:
        """Release what the engine holds (streams); its late copies' releases run as they land."""
