"""Block tables: per request row, logical block -> physical block (slot ID), int32.

The rules of vLLM's BlockTable (docs/design.md, engine side): rows grow by append; a row moved to
another index has its source cleared (a stale row may be dereferenced later, for
example by a dummy batch); clearing a row zeroes it; rows past the batch are the
null block; the host copy is the authority and a device mirror is committed
before slot mapping. When a restore puts blocks in new slots, the row is
rewritten; slot mappings are recomputed every step, never stored.
"""

from __future__ import annotations

import numpy as np
import torch

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import NULL_BLOCK


class BlockTable:
    """A host table (the authority) and its device mirror."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, device: str | torch.device = "cpu") -> None:
        if max_num_reqs < 1 or max_blocks_per_req < 1:
            raise InvalidArgument("a block table needs at least one row and one column")
        device = torch.device(device)
        self.host = torch.zeros((max_num_reqs, max_blocks_per_req), dtype=torch.int32,
                                pin_memory=device.type == "cuda")
        self._np = self.host.numpy()
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)  # valid entries per row
        self.device_table = torch.zeros_like(self.host, device=device)

    @property
    def width(self) -> int:
        return self.host.shape[1]

    def row(self, r: int) -> list[int]:
        return self._np[r, :self.num_blocks[r]].tolist()

    def append_row(self, r: int, block_ids: list[int]) -> None:
        """Append newly allocated blocks to row ``r``."""
        if not block_ids:
            return
        start = int(self.num_blocks[r])
        if start + len(block_ids) > self.width:
            raise InvalidArgument(f"row {r} would hold {start + len(block_ids)} blocks; width is {self.width}")
        if NULL_BLOCK in block_ids:
            raise InvalidArgument("the null block is never allocated to a request")
        self._np[r, start:start + len(block_ids)] = block_ids
        self.num_blocks[r] = start + len(block_ids)

    def set_blocks(self, r: int, start: int, block_ids: list[int]) -> None:
        """Rewrite logical blocks ``[start, start + len)`` of row ``r`` (restored into new slots)."""
        if start < 0 or start + len(block_ids) > self.num_blocks[r]:
            raise InvalidArgument(f"logical blocks [{start}, {start + len(block_ids)}) are not in row {r} "
                                  f"({self.num_blocks[r]} blocks)")
        if NULL_BLOCK in block_ids:
            raise InvalidArgument("the null block is never allocated to a request")
        self._np[r, start:start + len(block_ids)] = block_ids

    def move_row(self, src: int, tgt: int) -> None:
        """Move row ``src`` to ``tgt`` and clear the source."""
        n = int(self.num_blocks[src])
        self._np[tgt, :] = 0
        self._np[tgt, :n] = self._np[src, :n]
        self.num_blocks[tgt] = n
        self.clear_row(src)

    def clear_row(self, r: int) -> None:
        self._np[r, :] = NULL_BLOCK
        self.num_blocks[r] = 0

    def commit(self, num_reqs: int, num_padded: int | None = None) -> torch.Tensor:
        """Copy rows ``[0, num_reqs)`` to the device; rows up to ``num_padded`` are the null block.

        Returns the device rows ``[0, num_padded)``, to be used for this step's slot
        mapping and attention.
        """
        num_padded = num_reqs if num_padded is None else num_padded
        if not 0 <= num_reqs <= num_padded <= self.host.shape[0]:
            raise InvalidArgument(f"cannot commit {num_reqs} rows padded to {num_padded}")
        self.device_table[:num_reqs].copy_(self.host[:num_reqs], non_blocking=True)
        self.device_table[num_reqs:num_padded] = NULL_BLOCK
        return self.device_table[:num_padded]


def batch_metadata(requests: list[tuple[int, int]], device: str | torch.device = "cpu"
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``query_start_loc`` (int32) and ``positions`` (int64) for a batch of
    ``(num_computed_tokens, num_new_tokens)`` per request: chunked prefills, a prefill
    continuing a half-filled block, decodes (one new token) and empty requests mix freely.
    Returns them and the number of tokens."""
    counts = [new for _, new in requests]
    if any(c < 0 for c in counts) or any(done < 0 for done, _ in requests):
        raise InvalidArgument("token counts must be >= 0")
    query_start_loc = torch.tensor(np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]), dtype=torch.int32)
    positions = torch.tensor(np.concatenate([np.arange(done, done + new) for done, new in requests] or [[]]),
                             dtype=torch.int64)
    return query_start_loc.to(device), positions.to(device), int(sum(counts))


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_row: list[int], seq_len: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference reader: one request's K and V (``[seq_len, H, D]``) of one layer,
    read through its block-table row and the cache views, as paged attention reads them."""
    block_size = k_cache.shape[1]
    if -(-seq_len // block_size) > len(block_row):
        raise InvalidArgument(f"{seq_len} tokens need more than the row's {len(block_row)} blocks")
    pos = torch.arange(seq_len)
    blocks = torch.tensor(block_row, dtype=torch.int64)[pos // block_size]
    return k_cache[blocks, pos % block_size], v_cache[blocks, pos % block_size]
