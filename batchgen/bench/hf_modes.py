"""The `transformers` baselines of the benchmark: ``hf_generate`` (static batches of ``generate``,
left-padded) and ``hf_generate_batch`` (its continuous batching, bucketed by output length),
run on a sample of each workload (`_hf_sample`)."""

from __future__ import annotations

import math
import time

import torch

from batchgen.bench.results import ModeResult, _progress
from batchgen.bench.workloads import Workload


def _hf_model(path: str, dtype: torch.dtype, device: str):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def run_hf_generate(
    model, workload: Workload, batch_size: int = 64, progress: bool = False
) -> ModeResult:
    device = next(model.parameters()).device
    rows = [
        (r.prompt_token_ids, r.output_len, r.n > 1) for r in workload.requests for _ in range(r.n)
    ]
    bar = _progress(workload, "hf_generate", progress)
    t0 = time.perf_counter()
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        width = max(len(p) for p, _, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _, _) in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        longest = max(o for _, o, _ in batch)
        with torch.no_grad():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=batch[0][2],
                pad_token_id=0,
                eos_token_id=None,
            )
        bar.update(sum(o for _, o, _ in batch))
    seconds = time.perf_counter() - t0
    bar.close()
    useful = workload.useful_tokens
    return ModeResult(tokens_per_s=useful / seconds, seconds=seconds, useful_tokens=useful, mfu=0.0)


def run_hf_generate_batch(
    model, workload: Workload, max_batch_tokens: int, progress: bool = False
) -> ModeResult:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    buckets: dict[int, list[list[int]]] = {}
    for r in workload.requests:
        buckets.setdefault(_bucket(r), []).extend([r.prompt_token_ids] * r.n)
    # No block sharing: with n = 16 copies of a prompt, prefix sharing made generate_batch
    # stall for minutes on CPU here.
    cb = ContinuousBatchingConfig(
        max_batch_tokens=max_batch_tokens,
        num_blocks=512,
        page_size=64,
        allow_block_sharing=False,
    )
    bar = _progress(workload, "hf_generate_batch", progress)
    t0 = time.perf_counter()
    for max_new, prompts in sorted(buckets.items()):
        gen = GenerationConfig(
            max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        outs = model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False
        )
        # generate_batch reports a failed request in its output instead of raising (e.g. the
        # DeepSeek-V3 MLA cache is not supported by its paged cache in transformers 5.x).
        for out in outs.values():
            if len(out.generated_tokens) < max_new:
                raise RuntimeError(
                    f"transformers generate_batch returned {len(out.generated_tokens)} of "
                    f"{max_new} tokens for a request: {getattr(out, 'error', None)}"
                )
        # Useful tokens of the bucket's requests (their own output lengths, not max_new).
        bar.update(sum(r.output_len * r.n for r in workload.requests if _bucket(r) == max_new))
    seconds = time.perf_counter() - t0
    bar.close()
    useful = workload.useful_tokens
    return ModeResult(
        tokens_per_s=useful / seconds,
        seconds=seconds,
        useful_tokens=useful,
        mfu=0.0,
        extra={"buckets": sorted(buckets)},
    )


def _bucket(request) -> int:
    """``generate_batch``'s ``max_new_tokens`` bucket of a request: its output length rounded
    up to a power of two."""
    return 1 << math.ceil(math.log2(request.output_len))


# Sequences of each workload the `transformers` baselines run on (full, quick).
HF_SEQUENCES = {"hf_generate": (128, 64), "hf_generate_batch": (64, 16)}


def _hf_sample(workload: Workload, quick: bool, mode: str) -> Workload:
    """The `transformers` baselines run on the first requests covering `HF_SEQUENCES`
    sequences (128 for ``generate``: two static batches of 64, one with ``--quick``; 64 for
    ``generate_batch``, the slowest mode, 16 with ``--quick``) and report their rate: tokens/s
    on a sample of the same distribution is representative, and the whole workload would take
    hours (4,096 rollouts at ~67 tokens/s)."""
    limit = HF_SEQUENCES[mode][1 if quick else 0]
    taken, seqs = [], 0
    for r in workload.requests:
        if seqs >= limit:
            break
        taken.append(r)
        seqs += r.n
    return Workload(workload.name, taken)
