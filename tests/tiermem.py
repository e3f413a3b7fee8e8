"""Flip a byte of a block inside a daemon's host tier, as a bad DIMM or a stray write would."""

import re
from pathlib import Path

_REGION = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) rw-p [0-9a-f]+ 00:00 0\s*(\[heap\])?\s*$")


def flip_byte(pid: int, needle: bytes, at: int = 100) -> int:
    """Flip byte ``at`` of every copy of ``needle`` in the process's anonymous memory (the host
    tier is a plain allocation; the pools are memfd mappings and are skipped). Returns the count."""
    flipped = 0
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            match = _REGION.match(line)
            if not match:
                continue
            start, end = int(match.group(1), 16), int(match.group(2), 16)
            mem.seek(start)
            try:
                data = mem.read(end - start)
            except OSError:
                continue
            offset = data.find(needle)
            while offset >= 0:
                mem.seek(start + offset + at)
                mem.write(bytes([data[offset + at] ^ 0x5A]))
                flipped += 1
                offset = data.find(needle, offset + 1)
    return flipped
