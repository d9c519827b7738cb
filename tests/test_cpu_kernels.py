"""The CPU paged decode attention kernel against a plain softmax attention, and its build's
fallbacks (kernels off, no compiler)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchgen.kernels import cpu_build
from batchgen.kernels.paged_attention import decode_kernel_available, paged_decode_attention

needs_compiler = pytest.mark.skipif(
    not shutil.which(cpu_build.cxx_command()[0]), reason="no C++ compiler to build the kernel"
)


def _reference(q, k_seq, v_seq, scale, window):
    """``q [Hq, D]`` at position L - 1 over ``k_seq, v_seq [L, Hkv, D]``, HF's repeat_kv."""
    hq, hkv = q.shape[0], k_seq.shape[1]
    k = k_seq.repeat_interleave(hq // hkv, dim=1)
    v = v_seq.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k.double()) * scale
    length = k.shape[0]
    if window is not None:
        visible = torch.arange(length) > length - 1 - window
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v.double()).float()


@needs_compiler
@pytest.mark.parametrize(
    "hq,hkv,d,block_size,window,threads",
    [
        (8, 2, 64, 16, None, 2),  # the bench model's GQA
        (4, 4, 32, 4, None, 1),  # multi-head (G = 1), one thread
        (6, 1, 16, 8, 7, 2),  # multi-query, sliding window shorter than most contexts
        (8, 2, 128, 16, 1, 3),  # window 1: only the token itself; more threads than needed
        (4, 2, 12, 16, None, 2),  # head size not a multiple of 8: the generic (non-AVX2) loops
        (8, 8, 8, 4, 5, 1),  # one __m256 per head; G = 1 with a window
    ],
)
def test_kernel_matches_softmax_attention(hq, hkv, d, block_size, window, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    torch.manual_seed(0)
    kv_lens = [1, 2, block_size, block_size + 1, 3 * block_size - 1, 57, 200]
    num_blocks = sum(-(-n // block_size) for n in kv_lens) + 5
    k_cache = torch.randn(num_blocks * block_size, hkv, d)
    v_cache = torch.randn(num_blocks * block_size, hkv, d)
    perm = torch.randperm(num_blocks).tolist()  # scattered blocks
    tables, taken = [], 0
    for n in kv_lens:
        nb = -(-n // block_size)
        tables.append(perm[taken : taken + nb])
        taken += nb
    width = max(len(t) for t in tables)
    # Padding entries point past the cache: the kernel must not read past a context.
    block_tables = torch.tensor([t + [10**9] * (width - len(t)) for t in tables])
    q = torch.randn(len(kv_lens), hq, d) * 3  # sharp softmax
    out = torch.full((len(kv_lens), hq, d), float("nan"))
    scale = d**-0.5
    paged_decode_attention(
        q, k_cache, v_cache, block_tables, torch.tensor(kv_lens), block_size, scale, window, out
    )
    for i, n in enumerate(kv_lens):
        slots = torch.tensor(
            [tables[i][p // block_size] * block_size + p % block_size for p in range(n)]
        )
        expect = _reference(q[i], k_cache[slots], v_cache[slots], scale, window)
        torch.testing.assert_close(out[i], expect, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_kernel_rejects_heads_not_divisible():
    q = torch.randn(1, 3, 8)
    cache = torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="Hq=3, Hkv=2"):
        paged_decode_attention(
            q, cache, cache, torch.tensor([[0]]), torch.tensor([1]), 4, 1.0, None, q.clone()
        )


def test_kernels_off_by_env(monkeypatch):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "0")
    assert not decode_kernel_available(torch.device("cpu"), torch.float32)
    assert cpu_build.load_library("paged_decode_attention") is None


@pytest.mark.parametrize(
    "value, attention, moe",
    [
        ("paged_decode_attention", True, False),
        ("fused_moe", False, True),
        (" fused_moe , paged_decode_attention ", True, True),
        ("1", True, True),
        ("", True, True),
        ("No", False, False),
        ("OFF", False, False),
        ("on", True, True),
        ("Fused_MoE", False, True),
    ],
)
def test_kernels_chosen_by_name(monkeypatch, value, attention, moe):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", value)
    assert cpu_build.kernels_enabled("paged_decode_attention") is attention
    assert cpu_build.kernels_enabled("fused_moe") is moe
    if not attention:
        assert cpu_build.load_library("paged_decode_attention") is None
    if not moe:
        assert cpu_build.load_library("fused_moe") is None


@pytest.mark.parametrize(
    "value, bad", [("fused_moe,flash_attn", "'flash_attn'"), (",", "''"), ("fused_moe,0", "'0'")]
)
def test_unknown_kernel_name_is_refused_naming_the_allowed_values(monkeypatch, value, bad):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", value)
    with pytest.raises(ValueError, match=f"unknown kernel name {bad}; allowed: 1/on") as err:
        cpu_build.kernels_enabled("fused_moe")
    names = "fused_moe, invariant_linear, moe_routing, packed_linear, paged_decode_attention, "
    assert names + "prefill_attention, rms_norm, rotary_embedding" in str(err.value)


def test_build_failure_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="batchgen.kernels.cpu_build"):
        assert cpu_build.load_library("paged_decode_attention") is None
        assert cpu_build.load_library("paged_decode_attention") is None
    assert len([r for r in caplog.records if "not built" in r.getMessage()]) == 1


@needs_compiler
def test_cxx_with_a_compiler_wrapper_is_split_like_a_command_line(monkeypatch, tmp_path, caplog):
    """``CXX="wrapper c++"`` (as ccache is used) runs the wrapper with the compiler as its
    first argument, instead of looking for a program named "wrapper c++"."""
    log = tmp_path / "calls.txt"
    wrapper = tmp_path / "my wrapper"  # a space in the path: quoted in CXX
    wrapper.write_text(f'#!/bin/sh\necho "$1" >> "{log}"\nexec "$@"\n')
    wrapper.chmod(0o755)
    compiler = shutil.which(cpu_build.cxx_command()[0])
    monkeypatch.setenv("CXX", f"'{wrapper}' {compiler}")
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert cpu_build.cxx_command() == [str(wrapper), compiler]
    with caplog.at_level(logging.WARNING, logger="batchgen.kernels.cpu_build"):
        assert cpu_build.load_library("paged_decode_attention") is not None
    assert not caplog.records
    assert log.read_text().splitlines() == [compiler] * 3  # --version, compile, link


@needs_compiler
def test_a_changed_header_rebuilds_the_library(monkeypatch, tmp_path):
    """The cache key covers the headers beside a source (fused_moe.cpp includes its
    micro-kernels from csrc/*.h): editing one gives a new library, not the cached one."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "probe.cpp").write_text('#include "probe.h"\nextern "C" int probe() { return VALUE; }\n')
    built = []
    for value in (1, 2):
        (src / "probe.h").write_text(f"#define VALUE {value}\n")
        built.append(cpu_build._build(src / "probe.cpp", cpu_build.cxx_command()))
        assert ctypes.CDLL(str(built[-1])).probe() == value
    assert built[0] != built[1]


def test_cxx_unset_or_empty_is_cpp(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    assert cpu_build.cxx_command() == ["c++"]
    monkeypatch.setenv("CXX", " ")
    assert cpu_build.cxx_command() == ["c++"]
    monkeypatch.setenv("CXX", "ccache g++ -fno-plt")
    assert cpu_build.cxx_command() == ["ccache", "g++", "-fno-plt"]


def test_only_cpu_float32_and_bfloat16_are_served():
    assert not decode_kernel_available(torch.device("cpu"), torch.float16)
    assert not decode_kernel_available(torch.device("meta"), torch.float32)


def _expect_value_errors(q, cache, tables, lens, cases) -> None:
    """Each ``(change, message)``: the valid call with ``change`` applied raises ValueError
    matching ``message``."""
    for change, message in cases:
        args = dict(
            q=q,
            k_cache=cache,
            v_cache=cache,
            block_tables=tables,
            kv_lens=lens,
            block_size=4,
            scale=1.0,
            sliding_window=None,
            out=torch.empty_like(q),
        )
        args.update(change)
        with pytest.raises(ValueError, match=message):
            paged_decode_attention(**args)


@needs_compiler
def test_kernel_checks_what_it_would_read():
    q = torch.randn(2, 4, 8)
    cache = torch.randn(3 * 4, 2, 8)  # 3 blocks of 4
    tables = torch.tensor([[0, 1], [2, 10**9]])  # the second row's padding is never read
    lens = torch.tensor([8, 3])
    paged_decode_attention(q, cache, cache, tables, lens, 4, 1.0, None, torch.empty_like(q))
    cases = [
        (dict(kv_lens=torch.tensor([9, 3])), "kv_lens must be in \\[1, 8\\]"),
        (dict(kv_lens=torch.tensor([0, 3])), "kv_lens must be in"),
        (dict(block_tables=torch.tensor([[0, 3], [2, 0]])), "entries must be in \\[0, 3\\)"),
        (dict(block_tables=torch.tensor([[0, -1], [2, 0]])), "entries must be in"),
        (dict(q=q.double()), "q must be a float32 or bfloat16 CPU tensor"),
        (dict(k_cache=cache.bfloat16()), "k_cache must be a torch.float32 CPU tensor like q"),
        (dict(out=torch.empty_like(q).bfloat16()), "out must be a torch.float32 CPU tensor"),
        (dict(isa="avx9"), "isa must be one of"),
        (dict(k_cache=torch.randn(12, 8, 2).transpose(1, 2)), "k_cache must be contiguous"),
        (dict(kv_lens=lens.int()), "must be int64"),
        (dict(block_tables=tables[:1]), "one row per query"),
    ]
    _expect_value_errors(q, cache, tables, lens, cases)


@needs_compiler
def test_loading_the_kernel_keeps_subnormals(tmp_path, monkeypatch):
    """A shared library linked with -ffast-math turns on flush-to-zero in the thread that loads
    it; the build links without it, so torch keeps IEEE subnormals after the kernel loads."""
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))  # a fresh build
    assert cpu_build.load_library("paged_decode_attention") is not None
    tiny = torch.tensor(1e-38) / 1e3  # 1e-41 is subnormal in float32
    assert tiny.item() != 0.0


@needs_compiler
def test_kernel_rejects_wrong_ranks_and_windows():
    q = torch.randn(2, 4, 8)
    cache = torch.randn(12, 2, 8)
    tables, lens = torch.tensor([[0, 1], [2, 0]]), torch.tensor([8, 3])
    cases = [
        (dict(block_tables=tables[:, :, None]), "block_tables must have 2 dimensions"),
        (dict(q=q[0]), "q must have 3 dimensions"),
        (dict(k_cache=cache[0]), "k_cache must have 3 dimensions"),
        (dict(sliding_window=0), "sliding_window must be None or a positive int, got 0"),
        (dict(block_size=5), "must be a multiple of block_size"),
        (dict(block_size=4.0), "block_size must be a positive int"),
    ]
    _expect_value_errors(q, cache, tables, lens, cases)


@needs_compiler
def test_kernel_turned_back_on_is_used_again(monkeypatch):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "0")
    assert not decode_kernel_available(torch.device("cpu"), torch.float32)
    with pytest.raises(RuntimeError, match="not available"):
        q = torch.randn(1, 2, 4)
        c = torch.randn(4, 2, 4)
        paged_decode_attention(q, c, c, torch.tensor([[0]]), torch.tensor([1]), 4, 1.0, None, q)
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "1")
    assert decode_kernel_available(torch.device("cpu"), torch.float32)


# Loads the kernel in a fresh process and checks one decode against plain softmax attention.
_LOAD_AND_RUN = """
import torch
from batchgen.kernels import cpu_build
from batchgen.kernels.paged_attention import paged_decode_attention

assert cpu_build.load_library("paged_decode_attention") is not None, "kernel not built"
torch.manual_seed(0)
q, cache = torch.randn(1, 2, 8), torch.randn(8, 2, 8)
out = torch.empty_like(q)
paged_decode_attention(
    q, cache, cache, torch.tensor([[1]]), torch.tensor([3]), 4, 0.5, None, out
)
k = cache[4:7]  # block 1, first 3 slots: [L, H, D]
weights = torch.softmax(torch.einsum("hd,lhd->hl", q[0], k) * 0.5, -1)
torch.testing.assert_close(out[0], torch.einsum("hl,lhd->hd", weights, k))
print("kernel ok")
"""


@needs_compiler
def test_a_damaged_cached_kernel_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    """A cached library cut short (a crash mid-write, a disk fault) used to be mapped as is and
    end the process with SIGBUS; it must be rebuilt. The load runs in its own process."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    source = cpu_build.CSRC / "paged_decode_attention.cpp"

    def build() -> Path:  # what load_library does before dlopen
        return cpu_build._build(source, cpu_build.cxx_command())

    def stamp_of(library: Path) -> str:
        data = library.read_bytes()
        return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"

    library = build()
    stamp = library.with_name(library.name + ".stamp")
    assert stamp.read_text() == stamp_of(library)
    size, inode = library.stat().st_size, library.stat().st_ino
    assert build() == library and library.stat().st_ino == inode  # intact: not rebuilt

    with open(library, "r+b") as f:  # cut short in place, as a crash mid-write leaves it
        f.truncate(size // 2)
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_RUN],
        env={**os.environ, "BATCHGEN_CPU_KERNELS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # -7: SIGBUS
    assert proc.stdout.strip() == "kernel ok"
    assert "does not match its stamp; rebuilding" in proc.stderr
    assert library.stat().st_size == size and stamp.read_text() == stamp_of(library)

    inode = library.stat().st_ino
    stamp.unlink()  # e.g. a cache written before stamps: rebuilt, then stamped
    assert build() == library and library.stat().st_ino != inode
    assert stamp.read_text() == stamp_of(library)


@needs_compiler
def test_a_first_use_build_says_so_and_a_cached_one_is_silent(monkeypatch, tmp_path, caplog):
    """The first step waits while a kernel compiles (seconds each, longer on a busy machine): the
    log says which kernel, where, and how long it took, so the stalled progress bar has a
    reason; loading the cached library logs nothing."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(cache))
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "probe.cpp").write_text('extern "C" int probe() { return 7; }\n')
    with caplog.at_level(logging.INFO, logger="batchgen.kernels.cpu_build"):
        first = cpu_build._build(src / "probe.cpp", cpu_build.cxx_command())
    messages = [r.getMessage() for r in caplog.records]
    expected = f"compiling CPU kernel probe into {cache / 'kernels'} (first use; cached)"
    assert messages[0] == expected
    assert len(messages) == 2 and messages[1].startswith("compiled CPU kernel probe in ")
    assert messages[1].endswith(" s")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="batchgen.kernels.cpu_build"):
        assert cpu_build._build(src / "probe.cpp", cpu_build.cxx_command()) == first
    assert not caplog.records


@needs_compiler
@pytest.mark.parametrize("name", cpu_build.KERNEL_NAMES)
def test_every_kernel_source_builds_and_loads_where_a_compiler_exists(name):
    """A kernel that stops compiling must fail here, not turn into skips: `load_library` falls
    back to torch on a failed build (a WARNING), and the kernel tests then skip their cases
    ("kernel not built"), so a broken csrc/ file once passed the suite with 30 skips."""
    try:
        library = cpu_build._build(cpu_build.CSRC / f"{name}.cpp", cpu_build.cxx_command())
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"csrc/{name}.cpp does not compile:\n{exc.stderr}")
    ctypes.CDLL(str(library))  # raises OSError on an unresolved symbol
    assert sorted(p.stem for p in cpu_build.CSRC.glob("*.cpp")) == sorted(cpu_build.KERNEL_NAMES)
