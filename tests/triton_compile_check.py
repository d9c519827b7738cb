"""Compiles the Triton kernels ahead of time for a GPU target without a GPU (triton's own
``ptxas`` turns the PTX into a cubin): proves they type-check and lower for that architecture
in each dtype, which the interpreter cannot (it never runs the compiler). Run in a process
without ``TRITON_INTERPRET`` (the interpreter replaces ``triton.jit``):

    python tests/triton_compile_check.py [ARCH ...]     # default 90 (H100 / H200)

Prints one line per kernel, ``<name> ok shared=<bytes>``, and exits 1 when any fails.
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from batchgen.kernels import triton_attention_kernels as attention
from batchgen.kernels import triton_mla_kernels as mla
from batchgen.kernels import triton_moe_kernels as moe

DTYPES = {"bf16": (tl.bfloat16, "tf32"), "fp16": (tl.float16, "tf32"), "fp32": (tl.float32, "ieee")}


def kernels(dt: str):
    """``(name, jit function, signature, constexprs)`` of each kernel in dtype ``dt``, with the
    tile sizes the wrappers pick for the bench shapes (docs/gpu.md)."""
    round_to, precision = DTYPES[dt]
    i32 = "i32"
    for mul, c_dt in ((False, dt), (True, "fp32")):
        sig = dict(a_ptr="*" + dt, b_ptr="*" + dt, c_ptr="*" + c_dt, topk_weights_ptr="*fp32",
                   sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32",
                   num_tokens_post_padded_ptr="*i32", N=i32, K=i32, num_valid_tokens=i32,
                   stride_am=i32, stride_be=i32, stride_bn=i32, stride_cm=i32)  # fmt: skip
        consts = dict(A_DIV=1 if mul else 8, MUL_ROUTED_WEIGHT=mul, ROUND_TO=round_to,
                      DOT_PRECISION=precision, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)  # fmt: skip
        name = f"fused_moe_gemm {dt} {'down' if mul else 'gate_up'}"
        yield name, moe.fused_moe_gemm_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts
    sig = dict(gate_up_ptr="*" + dt, out_ptr="*" + dt, inter=i32, stride_in=i32, stride_out=i32)
    yield f"silu_and_mul {dt}", moe.silu_and_mul_kernel, {**sig, "BLOCK": "constexpr"}, {
        "BLOCK": 1024
    }
    sig = dict(q_ptr="*" + dt, k_cache_ptr="*" + dt, v_cache_ptr="*" + dt, out_ptr="*" + dt,
               block_tables_ptr="*i64", kv_lens_ptr="*i64", scale="fp32", sliding_window=i32,
               head_size=i32, block_size=i32, stride_qb=i32, stride_qh=i32, stride_cs=i32,
               stride_ch=i32, stride_ob=i32, stride_oh=i32, stride_bt=i32)  # fmt: skip
    consts = dict(GROUP=4, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, DOT_PRECISION=precision)
    yield (f"paged_decode_attention {dt}", attention.paged_decode_attention_kernel,
           {**sig, **dict.fromkeys(consts, "constexpr")}, consts)  # fmt: skip
    sig = dict(q_nope_ptr="*" + dt, q_pe_ptr="*" + dt, c_kv_ptr="*" + dt, k_pe_ptr="*" + dt,
               out_ptr="*" + dt, mid_out_ptr="*fp32", mid_lse_ptr="*fp32",
               block_tables_ptr="*i64", kv_lens_ptr="*i64", scale="fp32", num_heads=i32,
               kv_lora_rank=i32, rope_dim=i32, block_size=i32, stride_qb=i32, stride_qh=i32,
               stride_pb=i32, stride_ph=i32, stride_cs=i32, stride_ps=i32, stride_ob=i32,
               stride_oh=i32, stride_bt=i32)  # fmt: skip
    # DeepSeek-V3's latent (C = 512, Dr = 64) with the wrapper's tiles, unsplit and split.
    for splits in (1, 8):
        consts = dict(NUM_SPLITS=splits, BLOCK_H=16, BLOCK_C=512, BLOCK_R=64, BLOCK_N=32,
                      DOT_PRECISION=precision)  # fmt: skip
        yield (f"mla_decode_attention {dt} splits={splits}", mla.mla_decode_attention_kernel,
               {**sig, **dict.fromkeys(consts, "constexpr")}, consts)  # fmt: skip
    sig = dict(mid_out_ptr="*fp32", mid_lse_ptr="*fp32", out_ptr="*" + dt, kv_lens_ptr="*i64",
               num_heads=i32, kv_lora_rank=i32, stride_ob=i32, stride_oh=i32)  # fmt: skip
    consts = dict(NUM_SPLITS=8, BLOCK_C=512)
    yield (f"mla_decode_reduce {dt}", mla.mla_decode_reduce_kernel,
           {**sig, **dict.fromkeys(consts, "constexpr")}, consts)  # fmt: skip


def main(argv: list[str]) -> int:
    failed = 0
    for arch in [int(a) for a in argv] or [90]:
        target = GPUTarget("cuda", arch, 32)
        for dt in DTYPES:
            for name, fn, sig, consts in kernels(dt):
                try:
                    compiled = triton.compile(ASTSource(fn, sig, consts), target=target)
                    assert compiled.asm.get("cubin"), "no cubin"
                    print(f"sm_{arch} {name} ok shared={compiled.metadata.shared}")
                except Exception as exc:  # reported per kernel, all of them tried
                    failed += 1
                    print(f"sm_{arch} {name} FAILED {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
