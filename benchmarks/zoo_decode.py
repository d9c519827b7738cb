"""Per-architecture KV-cache bytes per token and decode tokens/s of the `make-model` configs.

    .venv/bin/python benchmarks/zoo_decode.py [--requests 64] [--output-len 64]

For each architecture: build the default tiny checkpoint (4 layers, hidden 128), run
``--requests`` greedy requests of 32 prompt tokens and ``--output-len`` generated tokens under
the default (coalesce) policy, and report the decode-only throughput from `LLM.get_metrics()`
(steps that contained only decode tokens), plus KV bytes per token in bf16 against the
uncompressed per-head K/V layout (which differs only for MLA).
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    from batchgen import LLM, SamplingParams
    from batchgen.engine.model_runner import kv_cache_bytes_per_token
    from batchgen.models.make_model import SUPPORTED_MAKE_ARCHS, make_model

    rows = []
    for arch in SUPPORTED_MAKE_ARCHS:
        path = make_model(arch, tempfile.mkdtemp(prefix=f"zoo-{arch}-"))
        llm = LLM(str(path), device="cpu", kv_cache_memory_gb=0.5)
        cfg = llm.llm_engine.model_config
        kv = kv_cache_bytes_per_token(cfg, torch.bfloat16)
        unc = kv
        if cfg.mla is not None:
            m = cfg.mla
            unc = (
                cfg.num_hidden_layers * cfg.num_attention_heads * (m.qk_head_dim + m.v_head_dim) * 2
            )
        prompts = [[1] + [5 + (i * 7 + j) % 400 for j in range(31)] for i in range(args.requests)]
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], sp, use_tqdm=False)
        llm.llm_engine.reset_metrics()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        m = llm.get_metrics()
        rows.append(
            {
                "arch": arch,
                "kv_bytes_per_token_bf16": kv,
                "uncompressed_kv_bytes_bf16": unc,
                "decode_tokens_per_s": m["decode_only_tokens"]
                / max(m["decode_only_seconds"], 1e-9),
                "generated_tokens_per_s": m["generated_tokens_per_s"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
