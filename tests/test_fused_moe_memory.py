"""Memory behaviour of the fused MoE CPU kernel's packed weights (`batchgen.kernels.fused_moe`):
packing on transparent huge pages (`empty_huge_pages`) or not, saved and copied, repacked after
a weight update, packed piece by piece (the weight streamer), and no kernel read outside x and
the packed weights (guard pages)."""

from __future__ import annotations

import sys

import pytest
import torch
from fused_moe_helpers import needs_amx, needs_bf16, needs_kernel
from fused_moe_helpers import reference as _reference
from fused_moe_helpers import routing as _routing
from fused_moe_helpers import weights as _weights

from batchgen.kernels import fused_moe as fm
from batchgen.models.layers.moe import sort_by_expert


def _huge_layer_weights(seed):
    """E 8, H 256, I 256: w13 packs to 4 MiB, w2 to 2 MiB (float32): w13 goes on huge pages
    (`empty_huge_pages` from two huge pages up), w2 stays a plain tensor."""
    return _weights(8, 256, 256, seed=seed)


@needs_kernel
def test_huge_page_packing_on_off_and_saved_give_the_same_bits(monkeypatch, tmp_path):
    """Packed weights on huge pages (a view at a 2 MiB offset of a larger uint8 buffer), off
    (`BATCHGEN_HUGE_PAGES=0`), after torch.save / torch.load and after a deepcopy: the same
    layout, the same kernel output bit for bit."""
    import copy

    from batchgen.engine import host_allocator

    w13, w2 = _huge_layer_weights(seed=22)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(23))
    weights, ids = _routing(40, 8, 2, seed=24)
    order, counts = sort_by_expert(ids, 8)
    monkeypatch.setenv("BATCHGEN_HUGE_PAGES", "1")
    p13_on, p2_on = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    if host_allocator._libc_madvise() is not None:
        assert p13_on.data_ptr() % host_allocator.HUGE_PAGE_BYTES == 0
    monkeypatch.setenv("BATCHGEN_HUGE_PAGES", "off")
    p13_off, p2_off = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    assert p13_off.storage_offset() == 0
    assert torch.equal(p13_on, p13_off) and torch.equal(p2_on, p2_off)
    torch.save((p13_on, p2_on), tmp_path / "packed.pt")
    p13_saved, p2_saved = torch.load(tmp_path / "packed.pt")
    p13_copy = copy.deepcopy(p13_on)
    outs = [
        fm.fused_moe_silu(x, a, b, weights, order, counts)
        for a, b in ((p13_on, p2_on), (p13_off, p2_off), (p13_saved, p2_saved), (p13_copy, p2_on))
    ]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(
        outs[0].double(), _reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5
    )


@needs_kernel
def test_a_block_with_huge_page_weights_repacks_after_a_weight_update():
    """`SparseMoeBlock` packs on first use; a write through ``param.data`` (what update_weights
    and the RL sync do) plus `invalidate_packed_weights` must give the new weights' result,
    not the old huge-page copy's."""
    from batchgen.models.layers.moe import SparseMoeBlock
    from batchgen.models.model_config import RouterConfig

    torch.manual_seed(25)
    block = SparseMoeBlock(256, 256, num_experts=8, top_k=2, router=RouterConfig())
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(26))
    with torch.no_grad():
        assert block.uses_kernel(x)
        before = block(x)
        old_p13 = block.packed_expert_weights()[0]
        new13, new2 = _huge_layer_weights(seed=27)
        block.w13_weight.data.copy_(new13)
        block.w2_weight.data.copy_(new2)
        block.invalidate_packed_weights()
        after = block(x)
        assert block.packed_expert_weights()[0] is not old_p13
        fresh = SparseMoeBlock(256, 256, num_experts=8, top_k=2, router=RouterConfig())
        fresh.load_state_dict(block.state_dict())
        assert torch.equal(after, fresh(x))
        assert not torch.equal(after, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_expert_weight_into_takes_a_strided_expert_and_names_a_wrong_destination(dtype):
    """The weight streamer packs each checkpoint piece with `pack_expert_weight_into`: a
    strided piece (a transposed tensor) packs like its contiguous copy; a destination of
    another shape is refused by name (it surfaced as torch's broadcast error)."""
    w13, _ = _weights(2, 32, 16, seed=39, dtype=dtype)
    whole = fm.pack_expert_weights(w13)
    strided = w13[1].t().contiguous().t()
    dst = torch.empty(fm.packed_expert_shape(32, 32, dtype), dtype=dtype)
    fm.pack_expert_weight_into(dst, strided)
    assert torch.equal(dst, whole[1])
    wrong = torch.empty(fm.packed_expert_shape(32, 16, dtype), dtype=dtype)
    with pytest.raises(ValueError, match="dst"):
        fm.pack_expert_weight_into(wrong, w13[1])


class _Guarded:
    """Copies of tensors placed against inaccessible (PROT_NONE) pages: ``before`` puts the
    first byte right after a guard page, ``after`` the last byte right before one, so a read
    past either end of x or the packed weights faults (a crash, not garbage) instead of
    reading a neighbour's memory. Software prefetches never fault, so they are not caught."""

    def __init__(self):
        import ctypes
        import mmap

        self._mmap, self._ctypes = mmap, ctypes
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._keep = []

    def __call__(self, t: torch.Tensor, where: str) -> torch.Tensor:
        page = self._mmap.PAGESIZE
        nbytes = t.numel() * t.element_size()
        pages = -(-nbytes // page)
        buf = self._mmap.mmap(-1, (pages + 2) * page)
        raw = torch.frombuffer(buf, dtype=torch.uint8)
        base = raw.data_ptr()
        for guard in (base, base + (pages + 1) * page):
            assert self._libc.mprotect(guard, page, 0) == 0  # PROT_NONE
        start = page if where == "before" else page + pages * page - nbytes
        view = raw[start : start + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        self._keep.append((buf, raw))
        return view


@needs_kernel
@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize(
    "dtype,isa,hidden,inter",
    [
        (torch.float32, "auto", 48, 24),
        (torch.float32, "avx2", 80, 40),
        pytest.param(torch.bfloat16, "avx512_bf16", 48, 24, marks=needs_bf16),
        pytest.param(torch.bfloat16, "amx", 160, 96, marks=needs_amx),
        pytest.param(torch.bfloat16, "amx", 288, 32, marks=needs_amx),
    ],
)
def test_no_read_outside_x_and_the_packed_weights(where, dtype, isa, hidden, inter):
    """Every expert with rows (top_k = E, so the first and last experts' weights, at the ends
    of the packed tensors, are read), skewed rows, a partial row block: no read outside x,
    w13_packed or w2_packed (a guard page at either end), and the same bits as unguarded."""
    if sys.platform != "linux":
        pytest.skip("guard pages through libc mprotect: Linux only")
    guarded = _Guarded()
    w13, w2 = _weights(4, hidden, inter, seed=40, dtype=dtype)
    p13, p2 = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    x = torch.randn(13, hidden, generator=torch.Generator().manual_seed(41)).to(dtype)
    weights, ids = _routing(13, 4, 4, seed=42, skew=3)
    order, counts = sort_by_expert(ids, 4)
    want = fm.fused_moe_silu(x, p13, p2, weights, order, counts, isa)
    got = fm.fused_moe_silu(
        guarded(x, where), guarded(p13, where), guarded(p2, where), weights, order, counts, isa
    )
    assert torch.equal(got, want)


def test_pack_expert_weights_keeps_the_device_of_its_input():
    """Before huge pages the packed copy stayed on w's device (``.contiguous()``); the huge-page
    buffer is host memory, so a meta (or CUDA) weight raised "Cannot copy out of meta tensor"
    (or came back on the CPU). Only CPU weights go to `empty_huge_pages`."""
    w = torch.empty(4, 32, 16, device="meta")
    packed = fm.pack_expert_weights(w)
    assert packed.device.type == "meta" and packed.shape == (4, 2, 16, 16)
    bf16 = fm.pack_expert_weights(w.bfloat16())
    assert bf16.device.type == "meta" and bf16.shape == (4, 2, 8, 16, 2)
