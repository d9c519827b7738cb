"""The kernel A/B benchmarks that patch a copy of the kernel sources still apply to them: a
header edited since would make `benchmarks/decode_scores_ab.py` fail at its first step (or,
worse, measure something else), so an edit that moves the patched code must update the patch.
"""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_transposed_scores_patch_applies_to_the_current_kernel():
    patch = ROOT / "benchmarks" / "patches" / "decode_bf16_transposed_scores.patch"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: git apply --check needs one")
    r = subprocess.run(
        ["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_the_stage_switches_find_their_lines_in_the_kernel():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "decode_scores_ab", ROOT / "benchmarks" / "decode_scores_ab.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines only: main() runs under __main__
    text = (mod.SRC / "paged_decode_attention_bf16.h").read_text()
    for old, _ in mod.SKIPS:
        assert text.count(old) == 1, old
