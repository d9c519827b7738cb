"""One ``batchgen run`` at a time per output file (`output_lock`), and the names of the files
kept beside an output (`sidecar_path`).

Two runs appending to one output each run the requests it lacks, so both write their results
(one result twice); a ``--retry-failed`` renaming its rewritten output over the path while
another run appends sends that run's later results to the replaced file, lost. So ``batchgen
run`` holds an exclusive advisory lock (``flock``) for the whole run on ``.<name>.lock``
beside the output (beside the file a symlinked output names), and a second run on the same
output is refused before it changes anything.

**Why a file beside it, not the output itself.** ``--retry-failed`` replaces the output's
file (a rename), so a lock on the output's inode would not cover the new file. The lock file
is never renamed; the holder removes it when it is done, while still holding the lock, and a
run that locked a file which is no longer the one at that path (removed or replaced in
between) tries again, so no two runs can both think they hold it. A run killed with SIGKILL
leaves the file, but not the lock: the kernel drops a ``flock`` with its last descriptor, so
the next run takes it. Where no file can be created beside the output (a directory that is
not writable), the output file itself is locked (no ``--retry-failed`` rename can happen
there either).

The lock is advisory and local: it excludes other ``batchgen run`` processes (on one machine,
or on a network file system whose ``flock`` reaches the server), not other programs, and two
hard links to one output are two paths with two lock files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from batchgen.entrypoints.batch_output import BatchFileError

# The longest file name most file systems take (ext4, xfs, btrfs, tmpfs: 255 bytes).
NAME_MAX = 255


class OutputLockedError(BatchFileError):
    """Another ``batchgen run`` holds the output's lock (message for the user)."""


def sidecar_path(output_path: str | os.PathLike, suffix: str) -> Path:
    """``.<name><suffix>`` beside the file ``output_path`` names (symlinks resolved).

    A name that would pass `NAME_MAX` bytes is shortened to its first characters plus a hash
    of the whole name, so that a long output name still gets a sidecar and two long names
    sharing a prefix get different ones.
    """
    real = Path(os.path.realpath(output_path))
    name = f".{real.name}{suffix}"
    if len(os.fsencode(name)) > NAME_MAX:
        digest = hashlib.sha256(os.fsencode(real.name)).hexdigest()[:16]
        head = os.fsencode(real.name)[:100].decode("utf-8", "ignore")
        name = f".{head}-{digest}{suffix}"
    return real.with_name(name)


def _holder(fd: int) -> str:
    """The pid the lock file names (written by the holder), or ``""``."""
    with contextlib.suppress(OSError, ValueError):
        text = os.pread(fd, 32, 0).decode("ascii").strip()
        if text.isdigit():
            return f" (pid {text})"
    return ""


def _locked(fd: int, path: Path, output_path: str | os.PathLike) -> None:
    """Lock ``fd`` or raise `OutputLockedError`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise OutputLockedError(
            f"another batchgen run{holder} is writing {output_path} (it holds {path}); wait "
            "for it to end, or stop it: two runs on one output would write some results twice "
            "or lose some"
        ) from None


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


@contextlib.contextmanager
def output_lock(output_path: str | os.PathLike) -> Iterator[Path | None]:
    """Hold the exclusive lock of ``output_path`` for the block (module docstring).

    Yields:
        The locked file (the lock file, or the output itself where no lock file can be
        created), or None where neither exists nor can be created (the run then fails to
        create its output anyway).

    Raises:
        OutputLockedError: another process holds it; nothing is changed.
        BatchFileError: the lock file's path is a symlink (never followed: the pid written
            there would land in the file it names).
    """
    lock_path = sidecar_path(output_path, ".lock")
    owned = True  # a lock file of ours, removed at the end
    while True:
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(lock_path, flags, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise BatchFileError(
                    f"{lock_path} (where batchgen run keeps the lock of {output_path}) is a "
                    "symlink; remove it"
                ) from None
            if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            lock_path, owned = Path(os.path.realpath(output_path)), False
            try:
                fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                yield None
                return
        _locked(fd, lock_path, output_path)
        if _same_file(fd, lock_path):
            break
        os.close(fd)  # removed or replaced since we opened it: lock the file there now
    # Write the pid only into a file that is nothing else (not a hard link to another file).
    held = os.fstat(fd)
    owned = owned and stat.S_ISREG(held.st_mode) and held.st_nlink == 1
    try:
        if owned:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        yield lock_path
    finally:
        if owned:
            with contextlib.suppress(OSError):
                os.unlink(lock_path)  # while still locked (module docstring)
        os.close(fd)
