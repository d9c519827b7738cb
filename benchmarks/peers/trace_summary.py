"""Where an engine's time goes, from a torch.profiler Chrome trace: the same reading for vLLM and
BatchGen (`run.py --profile DIR` writes one trace per engine).

    python benchmarks/peers/trace_summary.py DIR/vllm/*.pt.trace.json.gz DIR/batchgen/trace.json

Standard library only, so that it runs in either engine's venv. Reads the ``cpu_op`` events (and
``user_annotation`` ones other than steps: BatchGen names its C++ kernels by ``record_function``)
of the thread that runs the model (the one with the most operator time) and the step annotations
``execute_context_<R>(<T>)_generation_<R>(<T>)`` (vLLM's worker names its steps so; run.py
names BatchGen's the same way). Per operator class (`OP_CLASSES`, first match wins) it sums
*self* time: an operator's duration less that of the operators nested in it, so that nothing is
counted twice. "outside operators" is the time from the first step's start to the last step's
end not inside any operator on that thread: Python in the model runner, the scheduler where it
runs on that thread (BatchGen), building inputs, waiting for the next step (vLLM's worker waits
for its scheduler, which runs in another process). vLLM annotates ``execute_model`` only, so
its sampling (``sample_tokens``) falls between annotations but inside the span.

Units: seconds, and shares of that span.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections import defaultdict

# (class, regular expression on the operator name), first match wins.
OP_CLASSES = [
    ("compiled_graph", r"CompiledFxGraph|Pregraph|Postgraph|CompiledFunction"),
    ("step_inputs", r"slot_mapping|prepare_inputs"),
    ("moe_experts", r"fused_moe|fused_experts|moe|cpu_prepack"),
    ("attention", r"attention|attn|sdpa|flash|paged|reshape_and_cache|_softmax|bmm|baddbmm"),
    ("dense_gemm", r"^aten::(linear|addmm|mm|matmul)$|onednn|dnnl|mkldnn|invariant_linear"),
    ("sampling", r"sort|topk|argmax|multinomial|log_softmax|softmax|gumbel|exponential|sampl"),
    ("norm_rope_act", r"rms|norm|rotary|rope|silu|gelu|pow|rsqrt|mean"),
    ("copies_index", r"copy|index|gather|scatter|cat|stack|to$|_to_copy|clone|contiguous|fill"),
]
STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")


def classify(name: str) -> str:
    """The class of operator ``name`` (`OP_CLASSES`), else ``other_ops``."""
    for cls, pattern in OP_CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return cls
    return "other_ops"


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _self_times(ops: list[dict]) -> list[tuple[str, float]]:
    """(name, self seconds) of each operator: its duration less its nested operators'."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    out: list[list] = []
    stack: list[tuple[float, int]] = []  # (end us, index in out)
    for e in ops:
        ts, dur = e["ts"], e["dur"]
        while stack and stack[-1][0] <= ts:
            stack.pop()
        if stack:
            out[stack[-1][1]][1] -= dur
        out.append([e["name"], dur])
        stack.append((ts + dur, len(out) - 1))
    return [(n, d / 1e6) for n, d in out]


def summarize(path: str) -> dict:
    """The summary of one trace: steps, per-class self seconds, time outside operators."""
    events = [e for e in _load(path) if e.get("ph") == "X" and "dur" in e]
    per_thread: dict = defaultdict(list)
    for e in events:  # operators, and kernels named by record_function (BatchGen's)
        if e.get("cat") == "cpu_op" or (
            e.get("cat") == "user_annotation" and not STEP.fullmatch(e["name"])
        ):
            per_thread[(e["pid"], e["tid"])].append(e)
    if not per_thread:
        raise SystemExit(f"{path}: no cpu_op events")
    thread = max(per_thread, key=lambda k: sum(e["dur"] for e in per_thread[k]))
    steps = [e for e in events if STEP.fullmatch(e["name"])]
    if not steps:
        raise SystemExit(f"{path}: no execute_context_..._generation_... step annotations")
    first, last = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    ops = [e for e in per_thread[thread] if first <= e["ts"] < last]
    step_s = sum(e["dur"] for e in steps) / 1e6
    span_s = (last - first) / 1e6
    by_class: dict = defaultdict(float)
    by_op: dict = defaultdict(float)
    for name, s in _self_times(ops):
        by_class[classify(name)] += s
        by_op[name] += s
    in_ops = sum(by_class.values())
    decode = [e for e in steps if STEP.fullmatch(e["name"]).group(2) == "0"]
    decode_rows = [int(STEP.fullmatch(e["name"]).group(3)) for e in decode]
    tokens = [
        int(m.group(2)) + int(m.group(4)) for m in (STEP.fullmatch(e["name"]) for e in steps)
    ]
    return {
        "trace": path,
        "steps": len(steps),
        "step_seconds": step_s,
        "span_seconds": span_s,
        "outside_steps_seconds": span_s - step_s,
        "tokens_per_step": sum(tokens) / len(steps),
        "decode_only_steps": len(decode),
        "decode_rows_per_step": sum(decode_rows) / len(decode) if decode else 0.0,
        "decode_ms_per_step": 1e3 * sum(e["dur"] for e in decode) / 1e6 / len(decode)
        if decode
        else 0.0,
        "decode_us_per_row": 1e6 * sum(e["dur"] for e in decode) / 1e6 / sum(decode_rows)
        if decode_rows and sum(decode_rows)
        else 0.0,
        "classes": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
        "outside_ops_seconds": span_s - in_ops,
        "top_ops": sorted(by_op.items(), key=lambda kv: -kv[1])[:15],
    }


def format_summary(s: dict) -> str:
    lines = [
        f"{s['trace']}",
        f"  {s['span_seconds']:.2f} s from the first step to the last; steps {s['steps']} "
        f"({s['decode_only_steps']} decode-only), {s['step_seconds']:.2f} s inside the step "
        "annotations; "
        f"{s['tokens_per_step']:.0f} tokens/step; decode-only: {s['decode_rows_per_step']:.0f} "
        f"rows/step, {s['decode_ms_per_step']:.1f} ms/step, {s['decode_us_per_row']:.0f} us/row",
    ]
    total = s["span_seconds"]
    for cls, sec in [*s["classes"].items(), ("outside operators", s["outside_ops_seconds"])]:
        lines.append(f"  {cls:<18} {sec:8.2f} s  {100 * sec / total:5.1f}%")
    lines.append("  top operators (self s): " + ", ".join(f"{n} {t:.2f}" for n, t in s["top_ops"]))
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(format_summary(summarize(p)))
