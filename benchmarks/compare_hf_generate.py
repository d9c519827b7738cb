"""Tokens/s of `batchgen run` beside `transformers` `generate` on the same checkpoint and requests.

    .venv/bin/python benchmarks/compare_hf_generate.py [--model DIR] [--num-requests 500]
    .venv/bin/python benchmarks/compare_hf_generate.py --input examples/requests.jsonl

Both sides decode greedily with EOS ignored, so both produce exactly ``max_tokens`` tokens per
request (times ``n``) and the useful-token counts are equal. `transformers` runs static batches
of ``--hf-batch-size`` prompts, left-padded, each batch until its longest request is done (the
way people use it offline); only useful tokens count. Model loading is excluded on both sides.
Prints one JSON object. This is a precursor of `batchgen bench` (issue 4), not a replacement.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch


def synthetic_requests(n: int, seed: int = 0) -> list[dict]:
    """Completions with prompts of 16-512 words-ish and max_tokens 16-128, log-uniform."""
    rng = random.Random(seed)
    words = (
        "the of and to in is that for it as with was on be by at this from are or an invoice "
        "total amount date customer order extract field value summary report model expert token"
    ).split(" ")
    out = []
    for i in range(n):
        plen = int(round(2 ** rng.uniform(4, 9)))
        max_tokens = int(round(2 ** rng.uniform(4, 7)))
        prompt = " ".join(rng.choice(words) for _ in range(plen))
        out.append(
            {
                "custom_id": f"syn-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
            }
        )
    return out


def normalise(lines: list[dict]) -> list[dict]:
    """Greedy, EOS ignored, one sample: the same useful work for both engines."""
    out = []
    for i, line in enumerate(lines):
        body = dict(line.get("body", line))
        max_tokens = body.pop("max_completion_tokens", None) or body.get("max_tokens") or 16
        body.update(temperature=0, ignore_eos=True, n=1, max_tokens=max_tokens)
        for key in ("stop", "seed", "top_p", "logprobs", "top_logprobs", "min_tokens"):
            body.pop(key, None)
        out.append(
            {
                "custom_id": line.get("custom_id", f"line-{i}"),
                "method": "POST",
                "url": line.get("url", "/v1/completions"),
                "body": body,
            }
        )
    return out


def run_batchgen(llm, lines: list[dict], workdir: Path) -> dict:
    from batchgen.entrypoints.batch_runner import run_batch_file

    inp, out = workdir / "in.jsonl", workdir / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    t0 = time.perf_counter()
    summary = run_batch_file(llm.llm_engine, inp, out, progress=False)
    dt = time.perf_counter() - t0
    return {
        "seconds": dt,
        "generated_tokens": summary.generated_tokens,
        "tokens_per_s": summary.generated_tokens / dt,
        "failed": summary.failed,
    }


def run_hf(model_dir: str, llm, lines: list[dict], batch_size: int) -> dict:
    import transformers as tf

    eng = llm.llm_engine
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = []
    for line in lines:
        body = line["body"]
        if "messages" in body:
            ids = eng.apply_chat_template(body["messages"])
        elif isinstance(body["prompt"], list):
            ids = list(body["prompt"])
        else:
            ids = eng.tokenizer.encode(body["prompt"])
        prompts.append((ids, body["max_tokens"]))
    useful = sum(m for _, m in prompts)
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        longest = max(m for _, m in batch)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
    dt = time.perf_counter() - t0
    return {"seconds": dt, "generated_tokens": useful, "tokens_per_s": useful / dt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: embedded model)")
    parser.add_argument("--input", default=None, help="batch file (default: synthetic)")
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    args = parser.parse_args()
    from batchgen import LLM

    llm = LLM(args.model, device="cpu")
    model_dir = args.model or llm.llm_engine.config.model
    if args.input:
        lines = [json.loads(x) for x in Path(args.input).read_text().splitlines() if x.strip()]
    else:
        lines = synthetic_requests(args.num_requests)
    lines = normalise(lines)
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_batchgen(llm, lines, Path(tmp))
    hf = run_hf(model_dir, llm, lines, args.hf_batch_size)
    print(
        json.dumps(
            {
                "requests": len(lines),
                "batchgen": ours,
                "hf_generate": hf,
                "speedup": ours["tokens_per_s"] / hf["tokens_per_s"],
                "torch_threads": torch.get_num_threads(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
