"""Host (glibc) allocator settings for CPU inference.

An engine step allocates many short-lived activation tensors of 0.1-32 MiB (expert inputs
sorted by expert, gathered KV contexts, logits). glibc serves requests above its mmap
threshold (128 KiB at start) with fresh ``mmap`` pages and returns freed heap tops to the OS
above its trim threshold, so every step pays page faults and page zeroing on most of its
activations: on this project's 2-core machines a fresh 8 MiB ``index_select`` took 2.6 ms
against 0.4 ms into a reused buffer, and the bench model's MoE layer at 512-1024 tokens ran
about 1.5x faster once freed memory was kept for reuse (`tune_glibc_malloc`). The usual
remedies are jemalloc or tcmalloc via ``LD_PRELOAD`` (PyTorch's CPU performance guide); this
module gets most of the effect without a preload through glibc's ``mallopt``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

import torch

from batchgen.kernels.switches import env_flag

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_tuned = False


def tune_glibc_malloc(
    mmap_threshold_bytes: int = 32 << 20,
    trim_threshold_bytes: int = 1 << 30,
    top_pad_bytes: int = 64 << 20,
) -> bool:
    """Keep freed activation memory in the process heap for reuse (process-wide, once).

    Args:
        mmap_threshold_bytes: requests up to this size come from the heap (glibc's maximum is
            32 MiB on 64-bit).
        trim_threshold_bytes: free memory kept at the heap top before returning it to the OS.
        top_pad_bytes: extra bytes requested from the OS on each heap growth.
    Returns:
        True if applied; False when disabled with ``BATCHGEN_TUNE_MALLOC=0``, when the C
        library is not glibc (macOS, musl), or when already applied. Never raises.
    """
    global _tuned
    if _tuned or os.environ.get("BATCHGEN_TUNE_MALLOC", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = (
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
        and mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes) == 1
        and mallopt(_M_TOP_PAD, top_pad_bytes) == 1
    )
    _tuned = ok
    if ok:
        logger.debug(
            "glibc malloc: mmap threshold %d, trim threshold %d bytes",
            mmap_threshold_bytes,
            trim_threshold_bytes,
        )
    return ok


_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
HUGE_PAGE_BYTES = 2 << 20  # x86-64 and most arm64 kernels


def _libc_madvise():
    """libc's ``madvise`` (looked up once), or None off Linux or when it cannot be found."""
    global _madvise
    if _madvise is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    return _madvise or None


_madvise = None


HUGE_PAGES_ENV = "BATCHGEN_HUGE_PAGES"  # an on/off switch: off advises no huge pages


def huge_pages_enabled() -> bool:
    """False when ``BATCHGEN_HUGE_PAGES`` is ``0`` (also ``false``/``no``/``off``).

    Raises:
        ValueError: a value other than the on/off words (`switches.env_flag`; the engine
            checks it at start, `switches.check_kernel_switches`)."""
    return env_flag(HUGE_PAGES_ENV)


def advise_huge_pages(t) -> int:
    """Ask Linux to back a large CPU tensor with transparent huge pages (``madvise`` with
    ``MADV_HUGEPAGE``), before its memory is first touched.

    The paged KV cache is read in blocks scattered over gigabytes: with 4 KiB pages nearly
    every block read misses the TLB. Kernels whose THP mode is ``madvise`` (a common default)
    only give huge pages to regions that ask. Only the whole 2 MiB pages inside the tensor's
    memory are advised. Measured on one decode attention layer of 2,048 sequences x 448
    positions: 104 vs 120 ms (`batchgen.kernels.paged_attention`).

    Args:
        t: a contiguous CPU tensor not yet written (e.g. from ``torch.empty``).
    Returns:
        Bytes advised: 0 when not on Linux, `huge_pages_enabled` is False, the tensor is not
        a contiguous CPU tensor, it is smaller than two huge pages, or ``madvise`` fails (THP
        disabled).
    Raises:
        ValueError: only for a bad ``BATCHGEN_HUGE_PAGES`` value (`huge_pages_enabled`).
    """
    if sys.platform != "linux" or not huge_pages_enabled():
        return 0
    try:
        if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
            return 0
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
    except (AttributeError, RuntimeError):  # not a tensor, or no storage
        return 0
    lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi - lo < 2 * HUGE_PAGE_BYTES:
        return 0
    madvise = _libc_madvise()
    if madvise is None or madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        return 0
    return hi - lo


def empty_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new, uninitialised, contiguous CPU tensor whose memory starts on a 2 MiB boundary and
    is advised for transparent huge pages (`advise_huge_pages`) before it is first written.

    For large tensors read end to end many times, e.g. the fused MoE kernel's packed expert
    weights (`batchgen.kernels.fused_moe.pack_expert_weights`: a decode step streams every
    expert's weights once per layer). With 4 KiB pages the stream takes a TLB miss (a
    two-level page walk in a virtual machine) every 4 KiB; measured on the bench layer (E 64,
    H 512, I 256, top-8, one thread, process time, machine loaded by other jobs, same-run A/B):
    float32 at 16 tokens 7.30 -> 6.02 ms, 70 tokens 10.17 -> 8.51, 257 tokens 17.4 -> 16.4;
    bfloat16 at 16 tokens 2.67 -> 2.35, 70 tokens 3.66 -> 3.24.

    Args:
        shape: the tensor's sizes.
        dtype: its dtype.
    Returns:
        A ``torch.empty``-like tensor (a view at a 2 MiB-aligned offset of a buffer 2 MiB
        larger); a plain ``torch.empty`` when nothing was advised (smaller than two huge pages,
        ``BATCHGEN_HUGE_PAGES`` off, not Linux, or ``madvise`` failed).
    Raises:
        ValueError: a bad ``BATCHGEN_HUGE_PAGES`` value (`huge_pages_enabled`), besides
            ``torch.empty``'s own errors.
    """
    huge_pages_enabled()  # a bad value fails for small tensors too, not only large ones
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < 2 * HUGE_PAGE_BYTES:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    region = raw[offset : offset + nbytes]
    if advise_huge_pages(region) == 0:
        return torch.empty(shape, dtype=dtype)
    return region.view(dtype).view(shape)
