"""kvxfer's per-token-head cache write against vLLM 0.33's own (issue 34): the same bytes in the same
cells ([K(hs) | K_scale | V(hs) | V_scale], vLLM's Triton backend's packing), vLLM's kernel under Triton's
interpreter beside kvxfer's torch twin."""

import importlib.util
import inspect
import textwrap

import pytest
import torch
import triton
from vllm.v1.attention.ops import triton_reshape_and_cache_flash as vllm_ops

from kvxfer.engine.kernels import Kernel, cell_views, write_kv_quantized
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout

HS, HEADS, BLOCK = 16, 2, 4


def vllm_kernel(tmp_path):
    """vLLM's own ``_reshape_cache_per_token_head``, its source compiled with Triton (vLLM disables Triton
    on a CPU without Triton's CPU backend; the kernel then runs under Triton's interpreter)."""
    source = inspect.getsource(getattr(vllm_ops._reshape_cache_per_token_head, "fn",
                                       vllm_ops._reshape_cache_per_token_head))
    module = tmp_path / "vllm_per_token_head.py"
    module.write_text("import triton\nimport triton.language as tl\n\n\n" + textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location("vllm_per_token_head", module)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded._reshape_cache_per_token_head


def vllm_write(kernel, key, value, views, slots, codes):
    """What vLLM's ``triton_reshape_and_cache_flash_per_token_head_quant`` launches."""
    k, v, ks, vs = views
    qmax, qmin = vllm_ops._PER_TOKEN_HEAD_QUANT_PARAMS[codes]
    kernel[(key.shape[0], key.shape[1])](
        key, value, k, v, ks, vs, slots, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k.stride()[:3], *v.stride()[:3], *ks.stride(), *vs.stride(), block_size=k.shape[1], head_size=HS,
        head_size_v=HS, HEAD_SIZE_PADDED=triton.next_power_of_2(HS), QUANT_MAX=qmax, QUANT_MIN=qmin,
        IS_INT_QUANT=codes == torch.int8)


@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn])
def test_the_same_cells_as_vllms_kernel(codes, tmp_path):
    kernel = vllm_kernel(tmp_path)
    g = torch.Generator().manual_seed(1)
    if codes is torch.int8:
        key, value = (torch.randn(5, HEADS, HS, generator=g).to(torch.bfloat16) for _ in range(2))
    else:  # codes e4m3 represents exactly (Triton's interpreter rounds some float32 -> e4m3 casts wrongly)
        key, value = ((torch.randint(-100, 100, (5, HEADS, HS), generator=g).float().to(codes).float()
                       .index_fill_(2, torch.tensor([0]), 448.0) * 0.25).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([4, 9, 6, 15, 13], dtype=torch.int64)  # (vLLM writes block 0 too: none here)
    spec = KVSpec(1, 4, BLOCK, HEADS, 2 * HS + 8, torch.uint8, kv_parts=1)
    written = []
    for ours in (True, False):
        pl = PoolLayout(spec, PRESETS["BLHNC"])
        storage = torch.zeros(pl.nbytes, dtype=torch.uint8)
        (cells,), = pl.views(storage)
        views = cell_views(cells, HS, HS, codes)
        if ours:
            write_kv_quantized(key, value, views, slots, kernel=Kernel.TORCH)
        else:
            vllm_write(kernel, key, value, views, slots, codes)
        written.append(storage)
    assert torch.equal(written[0], written[1]) and written[0].any()
