"""Build a C++ source of ``csrc/`` into a shared library on first use and load it with ctypes.

The library is compiled with the system C++ compiler (``$CXX``, else ``c++``; split like a
shell command line, as make does, so a wrapper such as ``CXX="ccache c++"`` works) for this
machine's CPU (``-march=native``) and cached in ``<cache dir>/kernels`` (``$BATCHGEN_CACHE_DIR``
or ``~/.cache/batchgen``) under a key that hashes the source and every header beside it
(``csrc/*.h``), the flags, the compiler command and version and the CPU's feature flags, so a
changed source or header or a different machine never loads a stale build.
A build is written to a temporary name, fsync'ed and renamed into place; then a stamp file
beside it (``<name>.so.stamp``) records its size and SHA-256. A cached library is loaded only
when it matches its stamp: a library cut short (a crash mid-write, a disk fault) or without a
stamp is rebuilt instead of being mapped, which would end the process with SIGBUS.
ctypes (not a torch C++ extension) keeps the build to one small file that compiles in about a
second with no torch headers, and ctypes releases the GIL during each call.

``BATCHGEN_CPU_KERNELS=0`` turns every such kernel off (the engine then uses its pure-torch
path); a comma-separated list of kernel names (`KERNEL_NAMES`, e.g.
``BATCHGEN_CPU_KERNELS=paged_decode_attention``) turns on only those, for A/B measurements.
A build that fails logs one warning and the engine falls back the same way.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# Compile flags. Fast math lets GCC vectorize expf (glibc's libmvec) and the dot-product
# reductions; the kernels never produce or consume inf/NaN on valid input. It is given to the
# compile step only: linking a shared library with -ffast-math adds crtfastmath.o, which turns
# on flush-to-zero for subnormals in the loading thread, changing every later torch op there.
CXX_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp", "-pthread", "-lm"]
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


KERNEL_NAMES = (
    "fused_moe",
    "invariant_linear",
    "moe_routing",
    "packed_linear",
    "paged_decode_attention",
    "prefill_attention",
    "rms_norm",
    "rotary_embedding",
)  # the sources in csrc/


def kernels_enabled(name: str | None = None) -> bool:
    """Whether ``BATCHGEN_CPU_KERNELS`` lets the kernel ``name`` (None: any kernel) run.

    The variable is ``1`` (default; also ``true``/``yes``/``on``/unset/empty: all on), ``0``
    (``false``/``no``/``off``: all off), or a comma-separated list of names from
    `KERNEL_NAMES` (only those on). Case and spaces around names do not matter.

    Raises:
        ValueError: any other value (a name not in `KERNEL_NAMES`, a list with no name),
            naming the allowed values.
    """
    value = os.environ.get("BATCHGEN_CPU_KERNELS", "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    names = {n.strip() for n in value.split(",")}
    unknown = sorted(names - set(KERNEL_NAMES))
    if unknown:
        shown = ", ".join(repr(n) for n in unknown)
        raise ValueError(
            f"BATCHGEN_CPU_KERNELS={os.environ['BATCHGEN_CPU_KERNELS']!r}: unknown kernel "
            f"name {shown}; allowed: 1/on (all kernels), 0/off (none), or a comma-separated "
            f"list of kernel names from: {', '.join(KERNEL_NAMES)}"
        )
    return name is None or name in names


def _cache_dir() -> Path:
    root = os.environ.get("BATCHGEN_CACHE_DIR") or Path.home() / ".cache" / "batchgen"
    return Path(root) / "kernels"


def cpu_flags() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (``"flags : fpu ... avx512_bf16 ..."``), or the
    machine name where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def cxx_command() -> list[str]:
    """The C++ compiler command: ``$CXX`` split like a shell command line (a wrapper such as
    ``ccache c++`` or a compiler with options), ``["c++"]`` when unset or empty.

    Raises:
        ValueError: ``$CXX`` has unbalanced quotes (the message names ``CXX``).
    """
    value = os.environ.get("CXX", "")
    try:
        return shlex.split(value) or ["c++"]
    except ValueError as err:  # shlex's "No closing quotation"
        raise ValueError(f"CXX={value!r} is not a valid command line ({err})") from None


def _source_text(source: Path) -> bytes:
    """The bytes the cache key hashes for ``source``: the file, then every header of its
    folder (``*.h``, by name, each preceded by its name), so a changed header rebuilds every
    library; headers are small and the build takes about a second."""
    parts = [source.read_bytes()]
    for header in sorted(source.parent.glob("*.h")):
        parts += [header.name.encode(), header.read_bytes()]
    return b"\0".join(parts)


def _build(source: Path, cxx: list[str]) -> Path:
    text = _source_text(source)
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            [
                text,
                " ".join(CXX_FLAGS + LINK_FLAGS).encode(),
                shlex.join(cxx).encode(),
                version.encode(),
                cpu_flags().encode(),
            ]
        )
    ).hexdigest()[:16]
    out_dir = _cache_dir()
    target = out_dir / f"{source.stem}-{key}.so"
    if _matches_stamp(target):
        return target
    if target.exists() and _stamp_path(target).exists():
        logger.warning("cached CPU kernel %s does not match its stamp; rebuilding it", target)
    out_dir.mkdir(parents=True, exist_ok=True)
    # First use stalls the first step for a few seconds per kernel: say why.
    logger.info("compiling CPU kernel %s into %s (first use; cached)", source.stem, out_dir)
    started = time.perf_counter()
    # Build into a temporary name and rename: concurrent builders never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        obj = tmp + ".o"
        for cmd in (
            [*cxx, *CXX_FLAGS, "-c", str(source), "-o", obj],
            [*cxx, obj, "-o", tmp, *LINK_FLAGS],
        ):
            subprocess.run(cmd, capture_output=True, text=True, check=True)
        stamp = _fingerprint(tmp, sync=True)
        os.replace(tmp, target)
    finally:
        for path in (tmp, tmp + ".o"):
            if os.path.exists(path):
                os.unlink(path)
    # Written after the library is in place: a stamp never vouches for a file not yet there.
    _write_atomically(_stamp_path(target), stamp)
    logger.info("compiled CPU kernel %s in %.1f s", source.stem, time.perf_counter() - started)
    return target


def _stamp_path(library: Path) -> Path:
    return library.with_name(library.name + ".stamp")


def _fingerprint(path: str | Path, *, sync: bool = False) -> str:
    """``"<size> <sha256>"`` of a file; ``sync``: fsync it too (its data is on disk)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return f"{size} {digest.hexdigest()}"


def _matches_stamp(library: Path) -> bool:
    """True when ``library`` exists and has the size and SHA-256 its stamp file records."""
    try:
        return _stamp_path(library).read_text().strip() == _fingerprint(library)
    except OSError:  # no library or no stamp
        return False


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(name: str) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>.cpp``, or None when ``BATCHGEN_CPU_KERNELS`` turns it off or
    the build failed (logged once per process)."""
    if not kernels_enabled(name):
        return None
    with _lock:
        if name not in _loaded:
            try:
                _loaded[name] = ctypes.CDLL(str(_build(CSRC / f"{name}.cpp", cxx_command())))
            except (OSError, ValueError, subprocess.CalledProcessError) as exc:
                detail = getattr(exc, "stderr", "") or exc
                logger.warning(
                    "CPU kernel %s not built (%s); using the pure-torch path", name, detail
                )
                _loaded[name] = None
        return _loaded[name]
