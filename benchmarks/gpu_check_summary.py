"""Writes ``OUT/summary.md`` for `benchmarks/gpu_check.sh` from the files its stages left in
``OUT``: every stage's status (stages.tsv), the oracle tests' counts (junit-*.xml), the bench's
tokens/s per mode with tile density and the coalesce / lockstep ratio (bench.json), the
micro-benchmark's key figures (kernels.json) and the Triton tests' outcome (log.txt). A missing
or unreadable file is named, never fatal.

    python benchmarks/gpu_check_summary.py OUT [--dry-run 0|1] [--total-s SECONDS]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

STAGES = ("env", "install", "oracle_fp32", "oracle_bf16", "bench", "graphs", "kernels", "triton")


def _stages(out: Path) -> list[dict]:
    path = out / "stages.tsv"
    rows = list(csv.DictReader(path.open(), delimiter="\t")) if path.exists() else []
    seen = {r["stage"] for r in rows}
    rows += [dict(stage=s, status="not run", rc="-", seconds="0", cap_s="-") for s in STAGES
             if s not in seen]
    return rows


def _junit(path: Path) -> str:
    if not path.exists():
        return f"{path.name}: absent"
    try:
        root = ET.parse(path).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        a = {k: suite.get(k, "0") for k in ("tests", "failures", "errors", "skipped", "time")}
        fails = [
            f"{c.get('name')}: {(c.find('failure') or c.find('error')).get('message', '')[:160]}"
            for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ]
        line = (f"{path.name}: {a['tests']} tests, {a['failures']} failures, {a['errors']} "
                f"errors, {a['skipped']} skipped/xfail, {float(a['time']):.0f} s")
        return "\n".join([line] + [f"  - {f}" for f in fails])
    except Exception as exc:
        return f"{path.name}: unreadable ({type(exc).__name__}: {exc})"


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def _bench(path: Path) -> list[str]:
    if not path.exists():
        return ["bench.json: absent"]
    try:
        rec = json.loads(path.read_text())
    except Exception as exc:
        return [f"bench.json: unreadable ({type(exc).__name__}: {exc})"]
    lines = [f"{rec.get('dtype')} on {rec.get('device')}, model {rec.get('model')}", "",
             "| workload | mode | tokens/s | tile density | rows/GEMM | decode MFU |",
             "| --- | --- | --- | --- | --- | --- |"]
    ratios = []
    for name, w in rec.get("workloads", {}).items():
        for mode in ("lockstep", "coalesce"):
            r = w.get(mode)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {name} | {mode} | failed: {r['error'][:120]} | | | |")
                continue
            cells = [_fmt(r.get(k)) for k in
                     ("tile_density", "mean_rows_per_expert_gemm", "decode_mfu")]
            lines.append(f"| {name} | {mode} | {r['tokens_per_s']:.1f} | " + " | ".join(cells)
                         + " |")
        lo, co = w.get("lockstep", {}), w.get("coalesce", {})
        if lo.get("tokens_per_s") and co.get("tokens_per_s"):
            ratios.append(f"{name} {co['tokens_per_s'] / lo['tokens_per_s']:.2f}x")
    lines += ["", "coalesce / lockstep: " + (", ".join(ratios) or "-")]
    return lines


def _kernels(path: Path) -> list[str]:
    if not path.exists():
        return ["kernels.json: absent"]
    try:
        rec = json.loads(path.read_text())
    except Exception as exc:
        return [f"kernels.json: unreadable ({type(exc).__name__}: {exc})"]
    lines = [f"{rec.get('device_name')} {rec.get('dtype')}; peaks {rec.get('peak_tflops')} "
             f"TFLOP/s, {rec.get('peak_hbm_gbs')} GB/s"]
    mm = rec.get("matmul")
    if isinstance(mm, dict):
        lines.append(f"matmul: failed: {mm.get('error')}")
    elif mm:
        lines.append("matmul TFLOP/s by rows: " + ", ".join(
            f"{r['m']}: {r['tflops']:.3g} ({r['share_of_peak']:.1%})" for r in mm))
    moe = rec.get("moe")
    if moe and "error" in moe:
        lines.append(f"moe: failed: {moe['error']}")
    elif moe:
        lines.append(f"moe ({moe['path']}; H {moe['hidden']}, I {moe['moe_intermediate']}, "
                     f"E {moe['num_experts']}, top-{moe['top_k']}) TFLOP/s by rows/expert: "
                     + ", ".join(f"{r['rows_per_expert']}: {r['tflops']:.3g} "
                                 f"({r['share_of_peak']:.1%})" for r in moe["rows"]))
        for name, alt in moe.get("forced", {}).items():
            lines.append(f"  moe forced {name}: " + (f"failed: {alt['error']}" if "error" in alt
                         else ", ".join(f"{r['rows_per_expert']}: {r['tflops']:.3g}"
                                        for r in alt["rows"])))
    att = rec.get("attention")
    if att and "error" in att:
        lines.append(f"decode attention: failed: {att['error']}")
    elif att:
        lines.append(f"decode attention ({att['path']}) GB/s by seqs x context: " + ", ".join(
            f"{r['seqs']}x{r['context']}: {r['gbs']:.4g} ({r['share_of_hbm']:.1%} of HBM)"
            for r in att["rows"]))
        for name, alt in att.get("forced", {}).items():
            lines.append(f"  decode attention forced {name}: " + (
                f"failed: {alt['error']}" if "error" in alt
                else ", ".join(f"{r['seqs']}x{r['context']}: {r['gbs']:.4g}" for r in alt["rows"])))
    mla = rec.get("mla")
    if mla and ("error" in mla or "skipped" in mla):
        lines.append(f"MLA decode: {mla.get('error') or 'skipped: ' + mla['skipped']}")
    elif mla:
        lines.append(f"MLA decode ({mla['path']}; N {mla['num_heads']}, C {mla['kv_lora_rank']}, "
                     f"Dr {mla['qk_rope_head_dim']}) GB/s of latent by seqs x context: "
                     + ", ".join(f"{r['seqs']}x{r['context']}: {r['gbs']:.4g} "
                                 f"({r['share_of_hbm']:.1%} of HBM)" for r in mla["rows"]))
        for name, alt in mla.get("forced", {}).items():
            lines.append(f"  MLA decode forced {name}: " + (
                f"failed: {alt['error']}" if "error" in alt
                else ", ".join(f"{r['seqs']}x{r['context']}: {r['gbs']:.4g}" for r in alt["rows"])))
    return lines


def _env(out: Path) -> list[str]:
    log = out / "log.txt"
    if not log.exists():
        return ["log.txt: absent"]
    text = log.read_text(errors="replace")
    keep = [ln for ln in text.splitlines()
            if re.match(r"(torch |device |python |bf16 supported|MISSING_IMPORTS)", ln)]
    return keep or ["(no environment lines in log.txt)"]


def _triton(out: Path) -> list[str]:
    """The triton stage's pytest lines from log.txt: its failures (``-rfE``) and the count."""
    log = out / "log.txt"
    if not log.exists():
        return ["log.txt: absent"]
    text = log.read_text(errors="replace")
    start = text.find("=== triton (cap")
    if start < 0:
        return ["(the triton stage did not run)"]
    end = text.find("=== triton:", start)
    part = text[start : end if end >= 0 else None].splitlines()
    keep = [ln for ln in part if re.match(r"(FAILED|ERROR) ", ln)][:20]
    keep += [ln for ln in part if re.search(r"\d+ (passed|failed|error)", ln)][-1:]
    return keep or ["(no pytest result line: see log.txt)"]


def _graphs(out: Path) -> list[str]:
    """The ``DECODE_GRAPHS {...}`` line `benchmarks/decode_graphs.py` left in log.txt."""
    log = out / "log.txt"
    text = log.read_text(errors="replace") if log.exists() else ""
    found = re.findall(r"^DECODE_GRAPHS (\{.*\})$", text, re.M)
    if not found:
        return ["(the graphs stage left no result: see log.txt)"]
    r = json.loads(found[-1])
    rate = r["decode_tokens_per_s"]
    return [
        f"decode-only tokens/s: eager {rate['eager']:.0f}, graphs {rate['graphs']:.0f} "
        f"(graphs / eager {r['graphs_over_eager']:.2f}x); steps replayed "
        f"{r['cuda_graph_step_share']:.0%}; tokens equal: {r['tokens_equal']}; runner built: "
        f"{r['graph_runner_built']}" + (" (dry run: CPU stand-in, timing meaningless)"
                                          if r["dry_run"] else "")
    ]


def write_summary(out: Path, dry_run: bool, total_s: int | None) -> str:
    """Builds the summary's markdown, writes it to ``out/summary.md`` and returns it."""
    stages = _stages(out)
    lines = [f"# gpu_check summary{' (DRY RUN on CPU, tiny sizes)' if dry_run else ''}", "",
             f"total {total_s} s" if total_s is not None else "", "",
             "| stage | status | rc | seconds | cap s |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['stage']} | {r['status']} | {r['rc']} | {r['seconds']} | {r['cap_s']} |"
              for r in stages]
    lines += ["", "## environment", ""] + [f"    {ln}" for ln in _env(out)]
    lines += ["", "## oracle tests", ""]
    lines += [_junit(out / "junit-fp32.xml"), "", _junit(out / "junit-bf16.xml")]
    lines += ["", "## bench (lockstep vs coalesce)", ""] + _bench(out / "bench.json")
    lines += ["", "## CUDA graphs vs --enforce-eager (decode)", ""]
    lines += [f"- {ln}" for ln in _graphs(out)]
    lines += ["", "## kernels", ""] + [f"- {ln}" for ln in _kernels(out / "kernels.json")]
    lines += ["", "## Triton kernels vs their oracles", ""] + [f"    {ln}" for ln in _triton(out)]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--dry-run", type=int, default=0, choices=[0, 1])
    p.add_argument("--total-s", type=int, default=None)
    args = p.parse_args(argv)
    write_summary(args.out, bool(args.dry_run), args.total_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
