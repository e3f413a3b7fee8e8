"""KV-cache geometry: from a slot ID to byte addresses.

A pool holds, for every layer L and physical block B, the K and V vectors (KV)
of every KV head H and token N, each head_size (D) elements; or, for multi-head
latent attention (DeepSeek V2/V3, Kimi K2), one latent vector a token (``kv_parts``
1: the KV axis has one part, usually one "head" of the latent's width). A ``Layout`` is
the order of those six axes in memory, outermost first, D innermost. Byte
strides follow row-major order over that physical order, so the page of layer
``l``, block ``p`` starts at ``l * s_L + p * s_B`` bytes (docs/design.md, layouts).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from functools import cached_property

import torch

from kvxfer.core.errors import InvalidArgument

#: dtypes a pool may hold, by their canonical name.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a supported dtype ("bfloat16")."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidArgument(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}") from None


def parse_dtype(name: str) -> torch.dtype:
    """The dtype for a canonical name; accepts "torch.bfloat16" too."""
    key = name.removeprefix("torch.")
    try:
        return DTYPES[key]
    except KeyError:
        raise InvalidArgument(f"unknown dtype {name!r}; supported: {', '.join(DTYPES)}") from None


class Axis(enum.Enum):
    """The logical axes of a KV pool."""

    L = "L"  # layer
    B = "B"  # physical block (slot ID)
    KV = "KV"  # 0 = K, 1 = V (kv_parts 2); the latent alone (kv_parts 1, MLA)
    H = "H"  # KV head
    N = "N"  # token within the block
    D = "D"  # element within a head vector


@dataclass(frozen=True)
class KVSpec:
    """The geometry of one pool: what it holds, independent of memory order."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_parts: int = 2  # 2: K and V; 1: one latent vector a token (MLA), in the KV axis's one part

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"KVSpec.{field} must be a positive integer, got {value!r}")
        if type(self.kv_parts) is not int or self.kv_parts not in (1, 2):
            raise InvalidArgument(f"KVSpec.kv_parts must be 2 (K and V) or 1 (a latent, MLA), got {self.kv_parts!r}")
        if self.num_blocks < 2:
            raise InvalidArgument("KVSpec.num_blocks must be at least 2 (block 0 is the null block)")
        dtype_name(self.dtype)  # validates

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize  # no tensor made: this is on every request's path

    def axis_size(self, axis: Axis) -> int:
        return {
            Axis.L: self.num_layers,
            Axis.B: self.num_blocks,
            Axis.KV: self.kv_parts,
            Axis.H: self.num_kv_heads,
            Axis.N: self.block_size,
            Axis.D: self.head_size,
        }[axis]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (its span in block-major layouts)."""
        return self.num_layers * self.kv_parts * self.num_kv_heads * self.block_size * self.head_size * self.element_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": dtype_name(self.dtype),
            "kv_parts": self.kv_parts,
        }

    @classmethod
    def from_dict(cls, data: dict) -> KVSpec:
        fields = dict(data)
        fields["dtype"] = parse_dtype(str(fields["dtype"]))
        try:
            return cls(**fields)
        except TypeError as exc:
            raise InvalidArgument(f"bad KVSpec: {exc}") from None


@dataclass(frozen=True)
class Layout:
    """An order of the axes L, B, KV, H, N, D in memory, outermost first, D last."""

    order: tuple[Axis, ...]

    def __post_init__(self) -> None:
        if sorted(a.value for a in self.order) != sorted(a.value for a in Axis):
            raise InvalidArgument(f"a layout orders each of {[a.value for a in Axis]} exactly once, got {self.spelled}")
        if self.order[-1] is not Axis.D:
            raise InvalidArgument(f"D (head_size) must be the innermost axis, got {self.spelled}")

    @property
    def spelled(self) -> str:
        """The general form, e.g. "B,L,H,N,KV,D"."""
        return ",".join(a.value for a in self.order)

    @property
    def name(self) -> str:
        """The preset name if this is a preset, else the general form."""
        return _PRESET_NAMES.get(self.order, self.spelled)

    @property
    def block_major(self) -> bool:
        """True when B is outermost: one block over all layers is one byte run."""
        return self.order[0] is Axis.B

    @classmethod
    def parse(cls, text: str) -> Layout:
        """A preset name ("BLHNC", "flash_attn") or the general form ("L,KV,B,N,H,D").

        In the general form "C" may stand last for "KV,D", as in the preset names.
        """
        key = text.strip()
        preset = PRESETS.get(key.upper()) or PRESETS.get(key.lower())
        if preset is not None:
            return preset
        parts = [p.strip().upper() for p in key.replace(" ", ",").split(",") if p.strip()]
        if parts and parts[-1] == "C":
            parts[-1:] = ["KV", "D"]
        try:
            return cls(tuple(Axis(p) for p in parts))
        except ValueError:
            raise InvalidArgument(
                f"unknown layout {text!r}: use a preset ({', '.join(PRESETS)}) or axes like 'L,KV,B,N,H,D'"
            ) from None


def _letters(name: str) -> tuple[Axis, ...]:
    axes = [Axis(c) for c in name[:-1]]
    return (*axes, Axis.KV, Axis.D)


PRESETS: dict[str, Layout] = {
    # The six names of vLLM's KVCacheLayout (docs/design.md, layouts): C = [K | V] innermost.
    **{n: Layout(_letters(n)) for n in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")},
    # Engine layouts with K/V as an axis of its own (layers stacked outermost).
    "flash_attn": Layout((Axis.L, Axis.KV, Axis.B, Axis.N, Axis.H, Axis.D)),  # per layer [2, B, N, H, D]
    "flashinfer_nhd": Layout((Axis.L, Axis.B, Axis.KV, Axis.N, Axis.H, Axis.D)),  # per layer [B, 2, N, H, D]
    "flashinfer_hnd": Layout((Axis.L, Axis.B, Axis.KV, Axis.H, Axis.N, Axis.D)),  # per layer [B, 2, H, N, D]
    "flash_attn_cross_layer": Layout((Axis.B, Axis.L, Axis.KV, Axis.N, Axis.H, Axis.D)),  # [B, L, 2, N, H, D]
}
_PRESET_NAMES = {layout.order: name for name, layout in PRESETS.items()}
BLHNC = PRESETS["BLHNC"]


@dataclass(frozen=True, order=True)
class Run:
    """A contiguous byte range [offset, offset + length) of the pool."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def coalesce(runs: list[Run]) -> list[Run]:
    """Sort runs by offset and merge those that touch."""
    merged: list[Run] = []
    for run in sorted(runs):
        if merged and merged[-1].end == run.offset:
            merged[-1] = Run(merged[-1].offset, merged[-1].length + run.length)
        else:
            merged.append(run)
    return merged


@dataclass(frozen=True)
class PoolLayout:
    """A spec placed in memory by a layout: strides, offsets, runs and views."""

    spec: KVSpec
    layout: Layout

    @cached_property
    def strides(self) -> dict[Axis, int]:
        """Byte stride of each axis (row-major over the physical order)."""
        strides: dict[Axis, int] = {}
        step = self.spec.element_size
        for axis in reversed(self.layout.order):
            strides[axis] = step
            step *= self.spec.axis_size(axis)
        return {axis: strides[axis] for axis in self.layout.order}

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    @property
    def block_bytes(self) -> int:
        return self.spec.block_bytes

    def page_offset(self, layer: int, block: int) -> int:
        """First byte of layer ``layer`` of block ``block``."""
        self._check_block(block)
        if not 0 <= layer < self.spec.num_layers:
            raise InvalidArgument(f"layer {layer} out of range [0, {self.spec.num_layers})")
        return layer * self.strides[Axis.L] + block * self.strides[Axis.B]

    @property
    def run_length(self) -> int:
        """Bytes of one run of one block: everything inside the B axis."""
        return self.strides[Axis.B]

    @cached_property
    def _outer_offsets(self) -> tuple[int, ...]:
        """Offsets of block 0's runs: every index combination of the axes outside B."""
        outer = self.layout.order[: self.layout.order.index(Axis.B)]
        ranges = [range(self.spec.axis_size(a)) for a in outer]
        return tuple(
            sum(i * self.strides[a] for i, a in zip(index, outer)) for index in itertools.product(*ranges)
        )

    @property
    def runs_per_block(self) -> int:
        return len(self._outer_offsets)

    def block_runs(self, block: int) -> list[Run]:
        """The byte runs that hold one block, ascending (1 for block-major layouts)."""
        self._check_block(block)
        base = block * self.strides[Axis.B]
        return [Run(base + o, self.run_length) for o in self._outer_offsets]

    def runs(self, blocks: list[int]) -> list[Run]:
        """Coalesced byte runs covering exactly ``blocks`` (distinct), ascending."""
        if len(set(blocks)) != len(blocks):
            raise InvalidArgument("duplicate blocks in one request")
        for block in blocks:
            self._check_block(block)
        # Merge consecutive block IDs first: each group is one run per outer offset.
        groups: list[tuple[int, int]] = []
        for block in sorted(blocks):
            if groups and groups[-1][0] + groups[-1][1] == block:
                groups[-1] = (groups[-1][0], groups[-1][1] + 1)
            else:
                groups.append((block, 1))
        s_b = self.strides[Axis.B]
        return coalesce([Run(o + start * s_b, count * s_b) for o in self._outer_offsets for start, count in groups])

    def views(self, storage: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, K and V views ``[num_blocks, block_size, num_kv_heads, head_size]`` (one view,
        the latent, when ``kv_parts`` is 1).

        ``storage`` is the pool as a flat uint8 tensor of ``nbytes``; nothing is copied.
        """
        if storage.dtype != torch.uint8 or storage.dim() != 1 or storage.numel() != self.nbytes:
            raise InvalidArgument(f"storage must be a flat uint8 tensor of {self.nbytes} bytes")
        if not storage.is_contiguous():
            raise InvalidArgument("storage must be contiguous")
        elem = self.spec.element_size
        typed = storage.view(self.spec.dtype)
        st = {axis: stride // elem for axis, stride in self.strides.items()}
        size = (self.spec.num_blocks, self.spec.block_size, self.spec.num_kv_heads, self.spec.head_size)
        stride = (st[Axis.B], st[Axis.N], st[Axis.H], st[Axis.D])
        base = typed.storage_offset()
        return [
            tuple(  # type: ignore[misc]
                typed.as_strided(size, stride, base + layer * st[Axis.L] + kv * st[Axis.KV])
                for kv in range(self.spec.kv_parts)
            )
            for layer in range(self.spec.num_layers)
        ]

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.spec.num_blocks:
            raise InvalidArgument(f"block {block} out of range [0, {self.spec.num_blocks})")

    def describe(self) -> dict:
        """Everything a person needs to check an address by hand (the `kvxfer layout` output)."""
        return {
            "spec": self.spec.to_dict(),
            "layout": self.layout.name,
            "order": self.layout.spelled,
            "strides": {axis.value: stride for axis, stride in self.strides.items()},
            "nbytes": self.nbytes,
            "block_bytes": self.block_bytes,
            "runs_per_block": self.runs_per_block,
            "page_offsets": [
                [self.page_offset(layer, block) for block in range(self.spec.num_blocks)]
                for layer in range(self.spec.num_layers)
            ],
            "block_runs": [
                [[run.offset, run.length] for run in self.block_runs(block)] for block in range(self.spec.num_blocks)
            ],
        }
