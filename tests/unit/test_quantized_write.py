"""The cache write into a per-token-head quantised cache (issue 34): the Triton kernel under Triton's
interpreter equals its torch twin byte for byte, the cells are laid out as worked by hand, and decoding
(codes x scale) gives back the values to the code type's precision."""

import struct

import pytest
import torch

from kvxfer.core.errors import InvalidArgument
from kvxfer.engine.kernels import Kernel, cell_views, write_kv_quantized
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout

HS, HSV, HEADS, BLOCK = 8, 4, 2, 4  # a cell: 8 K codes, K's scale, 4 V codes, V's scale
CELL = HS + HSV + 8


def cache(layout: str = "BLHNC", blocks: int = 5) -> tuple[torch.Tensor, list]:
    spec = KVSpec(2, blocks, BLOCK, HEADS, CELL, torch.uint8, kv_parts=1)
    pl = PoolLayout(spec, PRESETS[layout])
    storage = torch.zeros(pl.nbytes, dtype=torch.uint8)
    return storage, [cells for (cells,) in pl.views(storage)]


def _inputs(codes: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 K and V for int8 codes. For fp8 codes, heads whose codes are exact: e4m3 values times a
    power of two, each head's largest 448 (Triton's interpreter rounds a float32 to e4m3 wrongly where the
    rounding carries into the exponent, 124.99 -> 64 where torch and GPUs give 128; on exact codes the
    kernel's addressing, scales and cells are compared byte for byte, and rounding is torch's own cast)."""
    g = torch.Generator().manual_seed(5)
    if codes is torch.int8:
        return (torch.randn(6, HEADS, HS, generator=g).to(torch.bfloat16) * 3,
                torch.randn(6, HEADS, HSV, generator=g).to(torch.bfloat16))
    exact = []
    for size in (HS, HSV):
        c = torch.randint(-100, 100, (6, HEADS, size), generator=g).float().to(torch.float8_e4m3fn).float()
        c[..., 0] = 448.0
        exact.append((c * 2.0 ** torch.randint(-4, 4, (6, HEADS, 1), generator=g)).to(torch.bfloat16))
    return exact[0], exact[1]


@pytest.mark.parametrize("codes", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC"])
def test_triton_equals_torch_byte_for_byte(codes, layout):
    key, value = _inputs(codes)
    key[2, 1] = 0  # an all-zero head: scale 1e-6, codes 0
    slots = torch.tensor([4, 5, 17, -1, 2, 9], dtype=torch.int64)  # padding and the null block write nothing
    written = []
    for kernel in (Kernel.TRITON, Kernel.TORCH):
        storage, layers = cache(layout)
        write_kv_quantized(key, value, cell_views(layers[1], HS, HSV, codes), slots, kernel=kernel)
        written.append(storage)
    assert torch.equal(written[0], written[1]) and written[0].any()
    if layout == "BLHNC":
        assert not written[0][:2 * BLOCK * HEADS * CELL].any()  # block 0, the null block, untouched


def test_a_cell_worked_by_hand_and_decoded():
    """Token 0 of head 1 into slot 5 (block 1, token 1) of layer 0, BLHNC (B, L, H, N, cell): the cell starts
    at block 1 x (2 layers x 2 heads x 4 tokens x 20) + head 1 x 80 + token 1 x 20 = 320 + 80 + 20 = 420."""
    key = torch.zeros(1, HEADS, HS)
    key[0, 1] = torch.tensor([1.0, -2.0, 4.0, 0.5, 0, 0, 0, 448.0 / 100])
    value = torch.zeros(1, HEADS, HSV)
    value[0, 1] = torch.tensor([-3.0, 1.0, 0, 0])
    storage, layers = cache()
    write_kv_quantized(key, value, cell_views(layers[0], HS, HSV, torch.float8_e4m3fn), torch.tensor([5]),
                       kernel=Kernel.TORCH)
    cell = bytes(storage[420:440].tolist())  # [K codes 0-8 | K scale 8-12 | V codes 12-16 | V scale 16-20]
    k_codes = torch.frombuffer(bytearray(cell[:8]), dtype=torch.float8_e4m3fn).float()
    v_codes = torch.frombuffer(bytearray(cell[12:16]), dtype=torch.float8_e4m3fn).float()
    (k_scale,), (v_scale,) = struct.unpack("<f", cell[8:12]), struct.unpack("<f", cell[16:20])
    assert k_scale == pytest.approx(4.48 / 448) and v_scale == pytest.approx(3.0 / 448)
    assert torch.allclose(k_codes * k_scale, key[0, 1], rtol=0.07) and k_codes.abs().max() == 448
    assert torch.allclose(v_codes * v_scale, value[0, 1], rtol=0.07)
    head0 = bytes(storage[340:360].tolist())  # head 0 (all zero): codes 0, both scales the floor 1e-6
    assert head0[:8] + head0[12:16] == bytes(12)
    assert struct.unpack("<f", head0[8:12]) + struct.unpack("<f", head0[16:20]) == pytest.approx((1e-6,) * 2)
    assert not storage[:340].any() and not storage[360:420].any() and not storage[440:].any()  # nothing else


def test_bad_shapes_and_cells_are_refused():
    storage, layers = cache()
    views = cell_views(layers[0], HS, HSV, torch.int8)
    with pytest.raises(InvalidArgument):
        cell_views(layers[0], HS, HSV + 4, torch.int8)
    with pytest.raises(InvalidArgument):
        cell_views(layers[0], HS, HSV, torch.bfloat16)
    with pytest.raises(InvalidArgument):
        write_kv_quantized(torch.zeros(2, HEADS, HS), torch.zeros(2, HEADS, HSV + 1), views, torch.tensor([5, 6]))
    with pytest.raises(InvalidArgument):
        write_kv_quantized(torch.zeros(2, HEADS, HS), torch.zeros(2, HEADS, HSV), views, torch.tensor([5]))


def test_the_torch_twin_rounds_as_torch_casts():
    """The twin's codes are torch's own float32 -> e4m3 cast of x / scale (round to nearest even)."""
    key = torch.tensor([[[124.9855, 448.0, -3.3, 0.01, 0, 0, 0, 0]] * HEADS])
    value = torch.zeros(1, HEADS, HSV)
    storage, layers = cache()
    views = cell_views(layers[0], HS, HSV, torch.float8_e4m3fn)
    write_kv_quantized(key, value, views, torch.tensor([5]), kernel=Kernel.TORCH)
    assert views[0][1, 1, 0].float().tolist() == key[0, 0].to(torch.float8_e4m3fn).float().tolist()
    assert views[2][1, 1, 0].item() == 1.0  # 448 / 448
