"""SGLang host layouts as kvxfer layouts, and the names of an SGLang engine's pages (no SGLang needed)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.core.errors import InvalidArgument
from kvxfer.geometry.layout import PoolLayout
from kvxfer.integrations.settings import parse_settings
from kvxfer.integrations.sglang.naming import MHA_LAYOUTS, MLA_LAYOUTS, HostGeometry, PageNames, RankShare
from kvxfer.integrations.sglang.pages import Settings


def sglang_dims(layout: str, mla: bool, layers: int, pages: int, page: int, heads: int, dim: int) -> tuple:
    """The host buffer's shape as SGLang 0.5.23's MHA/MLA host pools allocate it (pool_host/mha.py, mla.py)."""
    size = pages * page
    if mla:
        return {"layer_first": (layers, size, 1, dim), "page_first": (size, layers, 1, dim),
                "page_first_direct": (pages, layers, page, 1, dim)}[layout]
    return {"layer_first": (2, layers, size, heads, dim), "page_first": (2, size, layers, heads, dim),
            "page_first_direct": (2, pages, layers, page, heads, dim),
            "page_head": (2, pages, heads, page, layers, dim)}[layout]


def sglang_page(buffer: torch.Tensor, layout: str, mla: bool, p: int, page: int) -> torch.Tensor:
    """Page ``p`` as SGLang indexes it (its token axis is pages x page_size)."""
    if layout == "layer_first":
        return buffer[:, p * page:(p + 1) * page] if mla else buffer[:, :, p * page:(p + 1) * page]
    if layout == "page_first":
        return buffer[p * page:(p + 1) * page] if mla else buffer[:, p * page:(p + 1) * page]
    return buffer[p] if mla else buffer[:, p]


LAYOUTS = [(name, False) for name in MHA_LAYOUTS] + [(name, True) for name in MLA_LAYOUTS]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(LAYOUTS), st.integers(1, 4), st.integers(2, 5), st.sampled_from([1, 2, 4]),
       st.integers(1, 3), st.sampled_from([2, 8]), st.data())
def test_a_pages_bytes_are_where_sglang_keeps_them(which, layers, pages, page, heads, dim, data):
    layout, mla = which
    g = HostGeometry.of(mla=mla, host_layout=layout, num_layers=layers, num_pages=pages, page_size=page,
                        num_heads=heads, head_dim=dim, dtype=torch.float16)
    buffer = torch.arange(PoolLayout(g.spec, g.layout).nbytes // 2, dtype=torch.int16).view(torch.float16)
    buffer = buffer.view(sglang_dims(layout, mla, layers, pages, page, heads, dim))
    p = data.draw(st.integers(0, pages - 1))
    ours = buffer.view(-1).view(g.shape).select(g.page_axis, p)
    assert torch.equal(ours.reshape(-1).view(torch.int16), sglang_page(buffer, layout, mla, p, page)
                       .reshape(-1).view(torch.int16))
    # and the daemon's address arithmetic agrees: the page's runs hold exactly its elements
    runs = PoolLayout(g.spec, g.layout).block_runs(p)
    flat = buffer.view(-1).view(torch.uint8)
    stored = torch.cat([flat[r.offset:r.end] for r in runs])
    assert torch.equal(stored, ours.contiguous().view(-1).view(torch.uint8))


def test_layouts_kvxfer_cannot_address_are_refused_saying_why():
    common = dict(num_layers=2, num_pages=4, page_size=4, num_heads=2, head_dim=8, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgument, match="page_unified is not one of them"):
        HostGeometry.of(mla=False, host_layout="page_unified", **common)
    with pytest.raises(InvalidArgument, match="page_head is not one of them"):
        HostGeometry.of(mla=True, host_layout="page_head", **common)
    with pytest.raises(InvalidArgument, match="one head size"):
        HostGeometry.of(mla=False, host_layout="page_first", v_head_dim=4, **common)


def _names(model="m", layout="page_first", mla=False, share=RankShare(), tenant="", dtype=torch.bfloat16):
    g = HostGeometry.of(mla=mla, host_layout=layout, num_layers=2, num_pages=9, page_size=4, num_heads=2,
                        head_dim=8, dtype=dtype)
    return PageNames(model, g, share, tenant=tenant)


def test_namespaces_bind_what_determines_a_pages_bytes():
    base = _names()
    assert base.namespace == _names().namespace and base.cache_group == _names().cache_group
    others = [_names(model="n"), _names(layout="layer_first"), _names(share=RankShare(1, 2)),
              _names(share=RankShare(pp_rank=1, pp_size=2)), _names(dtype=torch.float16), _names(tenant="t")]
    assert len({n.namespace for n in [base, *others]}) == 1 + len(others)
    # a latent is the same on every tensor-parallel rank; a pipeline stage holds other layers
    assert _names(mla=True, share=RankShare(0, 2)).namespace == _names(mla=True, share=RankShare(1, 2)).namespace
    assert _names(mla=True).namespace != _names(mla=True, share=RankShare(pp_rank=1, pp_size=2)).namespace
    assert base.pool_id("host") != _names().pool_id("host")  # each process's pools are its own


def test_settings_are_checked_and_misspellings_named():
    parse = lambda extra: parse_settings(Settings, extra, where="x", foreign=frozenset({"allocator"}), engine="e")
    assert parse({"allocator": "shm", "staging_pages": 8}).staging_pages == 8
    with pytest.raises(ValueError, match=r"x\.staging_page: .*did you mean 'staging_pages'"):
        parse({"staging_page": 8})
    with pytest.raises(ValueError, match=r"x\.staging_pages: a whole number"):
        parse({"staging_pages": 0})
    with pytest.raises(ValueError, match=r"x\.timeout_s: a number of seconds"):
        parse({"timeout_s": "1"})
    with pytest.raises(ValueError, match=r"x\.socket: a string"):
        parse({"socket": ""})


def test_a_group_token_file_is_read_whole_and_checked(tmp_path):
    from kvxfer.integrations.settings import group_token

    good = tmp_path / "token"
    good.write_text("a" * 64 + "\n")
    assert group_token("x.token_file", str(good)) == b"a" * 64
    for text, words in (("short\n", "holds 5 bytes"), ("b" * 65, "holds 65 bytes")):
        good.write_text(text)
        with pytest.raises(ValueError, match=words):
            group_token("x.token_file", str(good))
    with pytest.raises(ValueError, match="x.token_file: .*No such file"):
        group_token("x.token_file", str(tmp_path / "absent"))
