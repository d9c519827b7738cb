"""The paged decode attention kernel reads ``q [B, Hq, D]`` in place when only its rows are
strided (q a view of the fused QKV projection's output, `batchgen.models.layers.attention`),
instead of copying it contiguous first: every path (generic, AVX2, AVX-512F float32,
AVX-512F / AVX512-BF16 / AMX bf16) gives the same bits as with a contiguous copy of q."""

import pytest
import torch

from batchgen.kernels import paged_attention as pa
from tests.test_paged_attention_f32 import _case

pytestmark = pytest.mark.skipif(
    not pa.decode_kernel_available(torch.device("cpu"), torch.float32), reason="kernel not built"
)


def _run(q, k, v, tables, lens, block_size, isa):
    out = torch.empty(q.shape, dtype=q.dtype)
    pa.paged_decode_attention(q, k, v, tables, lens, block_size, 0.125, None, out, isa=isa)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", sorted(pa.ISAS))
@pytest.mark.parametrize("kv_lens", [[5, 40, 17], [33]])
def test_q_view_of_fused_qkv_gives_the_contiguous_bits(dtype, isa, kv_lens):
    if not pa.decode_kernel_available(torch.device("cpu"), dtype):
        pytest.skip(f"no {dtype} kernel")
    hq, hkv, d, block_size = 8, 2, 64, 16
    q, k, v, tables, lens = _case(kv_lens, hq, hkv, d, block_size, seed=3)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    b = q.shape[0]
    qkv = torch.randn(b, (hq + 2 * hkv) * d).to(dtype)  # [B, (Hq + 2 Hkv) D], fused QKV
    qkv[:, : hq * d] = q.reshape(b, -1)
    view = qkv[:, : hq * d].view(b, hq, d)
    assert not view.is_contiguous() or b == 1
    assert pa.rows_strided_ok(view)
    want = _run(q.contiguous(), k, v, tables, lens, block_size, isa)
    got = _run(view, k, v, tables, lens, block_size, isa)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_q_layouts_are_copied_and_give_the_same_bits(dtype):
    if not pa.decode_kernel_available(torch.device("cpu"), dtype):
        pytest.skip(f"no {dtype} kernel")
    hq, hkv, d, block_size = 8, 2, 64, 16
    q, k, v, tables, lens = _case([7, 20], hq, hkv, d, block_size, seed=4)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    want = _run(q, k, v, tables, lens, block_size, "auto")
    heads_major = q.transpose(0, 1).contiguous().transpose(0, 1)  # [B, Hq, D], heads outer
    every_other = torch.stack((q, q), dim=-1)[..., 0]  # D strided by 2
    for layout in (heads_major, every_other):
        assert not pa.rows_strided_ok(layout)
        assert torch.equal(_run(layout, k, v, tables, lens, block_size, "auto"), want)


@pytest.mark.parametrize("dtype,isa", [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                       (torch.bfloat16, "generic")])  # fmt: skip
@pytest.mark.parametrize("specs", [[(15, 0), (16, 40), (17, 0)], [(1, 3)], [(40, 200), (2, 5)]])
def test_prefill_q_view_of_fused_qkv_gives_the_contiguous_bits(dtype, isa, specs):
    """The prefill kernel (``csrc/prefill_attention*``, generic and AMX) reads a q whose rows
    are strided in place too: the same bits as with a contiguous copy."""
    from tests.test_prefill_attention import make_case, run_kernel

    hq, hkv, d = 8, 2, 64
    q, kc, vc, spans = make_case(specs, hq, hkv, d, dtype, seed=5)
    t = q.shape[0]
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    qkv[:, : hq * d] = q.reshape(t, -1)
    view = qkv[:, : hq * d].view(t, hq, d)
    assert pa.rows_strided_ok(view)
    want = run_kernel(q.contiguous(), kc, vc, spans, d**-0.5, None, isa=isa)
    got = run_kernel(view, kc, vc, spans, d**-0.5, None, isa=isa)
    assert torch.equal(got, want)
