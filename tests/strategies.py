"""Hypothesis strategies shared by the property tests."""

import torch
from hypothesis import strategies as st

from kvxfer.geometry.layout import PRESETS, Axis, KVSpec, Layout

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8]


@st.composite
def specs(draw, max_blocks: int = 6) -> KVSpec:
    return KVSpec(
        num_layers=draw(st.integers(1, 4)),
        num_blocks=draw(st.integers(2, max_blocks)),
        block_size=draw(st.integers(1, 5)),
        num_kv_heads=draw(st.integers(1, 3)),
        head_size=draw(st.integers(1, 4)),
        dtype=draw(st.sampled_from(DTYPES)),
    )


@st.composite
def layouts(draw) -> Layout:
    """A preset, or any order of the five outer axes with D innermost."""
    if draw(st.booleans()):
        return draw(st.sampled_from(list(PRESETS.values())))
    outer = draw(st.permutations([Axis.L, Axis.B, Axis.KV, Axis.H, Axis.N]))
    return Layout((*outer, Axis.D))
