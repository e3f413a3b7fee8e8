"""The hints an application would send with a trace's requests, for ``kvxfer bench policy --hints``.

``session-end``: an application knows when a conversation ends; it stores the last turn's blocks with
RELEASE (an Offload carrying ``hint``), and the daemon evicts them first. The bench finds the turns
from the trace itself: a later request that repeats all but at most the last block of an earlier one
continues it (its last block is the partial one, which the next turn's prompt completes). A request
no later one continues is its conversation's last turn.

Hints are not always right: ``wrong`` is the share of continuing turns that are released as well (an
application that guesses a session ended when it did not), drawn with a fixed seed.
"""

from __future__ import annotations

import random

#: The hint rules ``--hints`` takes: none (plain LRU's decisions, through the same hinted index), session-end.
RULES = ("none", "session-end")


def last_turns(requests: list[list[int]]) -> list[bool]:
    """For each request, whether no later request continues it (repeats all but at most its last block; at
    least one block)."""
    last = [True] * len(requests)
    # A request's blocks but its last, as (length, chained hash of the prefix) -> the requests not continued yet.
    # (Chained hashes: each prefix costs O(1), not a tuple of its length; a 64-bit collision only misjudges a turn.)
    waiting: dict[tuple[int, int], list[int]] = {}
    for j, blocks in enumerate(requests):
        if not blocks:
            continue
        prefixes, h = [], 0
        for k, block in enumerate(blocks, 1):
            h = hash((h, block))
            prefixes.append((k, h))
            for i in waiting.pop((k, h), ()):
                last[i] = False
        waiting.setdefault(prefixes[max(1, len(blocks) - 1) - 1], []).append(j)
    return last


def released(requests: list[list[int]], rule: str, wrong: float = 0.0, seed: int = 0) -> list[bool]:
    """For each request, whether the application stores its blocks with RELEASE under ``rule``."""
    if rule == "none":
        return [False] * len(requests)
    rng = random.Random(seed)
    return [end or rng.random() < wrong for end in last_turns(requests)]
