"""The all-to-all under dispatch and combine: gloo, or shared memory when the expert-parallel
group lives on one host.

gloo has no shared-memory transport: two ranks on one machine exchange over loopback TCP, and
at the sizes of one MoE layer (0.1-1 MB per rank) that costs milliseconds a call, mostly in
socket wake-ups, far above the copy itself (measured: `benchmarks/a2a_trace.py`). vLLM's CPU
backend writes its own shared-memory communicator for the same reason. `ShmAllToAll` is ours:

- each rank owns two data segments in ``/dev/shm`` (one per op parity) and a row of a shared
  header: the op count it has published, its pid, each segment's generation, and the byte
  offset of each destination's chunk;
- op ``n``: a rank copies its send buffer into its parity ``n % 2`` segment, writes the offsets,
  then publishes ``n``; it then waits for each peer to publish ``n`` and copies the chunk meant
  for it straight out of the peer's segment. No "done reading" flag is needed: a rank writes
  parity ``p`` again at op ``n + 2``, after it saw every peer publish ``n + 1``, which a peer
  does only after it finished reading op ``n``;
- a segment too small is replaced by a larger one (a new generation); its file is unlinked one
  op later, when every peer has mapped it, so ``/dev/shm`` holds no file of ours between ops
  and a crash leaves at most one op's new segments;
- a segment never grows past `max_segment_bytes` (default `MAX_SEGMENT_BYTES`, 64 MiB;
  ``$BATCHGEN_A2A_SHM_SEGMENT_MB``): a larger all-to-all is carried in rounds, each one op,
  in which every rank sends at most ``q`` rows to each destination, ``q = max_segment_bytes
  // (W * row bytes)`` (at least 1), rows ``[j q, (j + 1) q)`` of each pair in round ``j``.
  Each rank publishes with its first round how many rounds it needs (as sender and as
  receiver); every rank reads every peer's figure in that round and runs the largest, so the
  ranks issue the same ops. Without the cap a segment grew to 1.5x the largest op, twice over
  (two parities), and stayed: 0.36-0.39 GB per rank on 256 rollouts of the bench model, and
  about 2.8 GB per parity for a 16,384-token prefill chunk at hidden 7,168 in bf16 with top-8;
- the wait spins briefly, then yields, then sleeps in steps of at most `MAX_SLEEP_S`; it checks
  every `LIVENESS_EVERY_S` that the peer process is alive and gives up after the group's
  timeout (``distributed_timeout_s``), with an error naming the peer rank: never a hang.

Publication relies on x86's ordered stores (the data copy, then the 8-byte counter store, are
seen in that order by the peer's loads), so `batchgen.distributed.transport.make_transport` picks
shared memory only on x86-64, when every rank can map a segment the first rank made, sees the
others' processes, and the device is the CPU; otherwise, and with
``BATCHGEN_A2A_TRANSPORT=gloo``, gloo.
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
import re
import time

import torch

TRANSPORT_ENV = "BATCHGEN_A2A_TRANSPORT"  # auto (default) | gloo | shm
SHM_DIR = "/dev/shm"
SPIN_S = 50e-6  # busy polling before yielding the core
YIELD_S = 1e-3  # sched_yield polling before sleeping
MAX_SLEEP_S = 100e-6
LIVENESS_EVERY_S = 0.05
MIN_SEGMENT_BYTES = 1 << 20
MAX_SEGMENT_BYTES = 64 << 20  # per segment; larger ops go in rounds (module docstring)
SEGMENT_MB_ENV = "BATCHGEN_A2A_SHM_SEGMENT_MB"
_HEAD = 4  # header words of a rank's row: seq, pid, gen[0], gen[1]
# then per parity W + 2 words: the W + 1 byte offsets of the chunks, and the rounds the rank
# needs for the all-to-all this op belongs to (read by the peers in its first round)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


_STALE = re.compile(r"^batchgen_a2a_[0-9a-f]{16}_pid(\d+)_")


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the all-to-all files in ``shm_dir`` whose creating process is gone.

    Every file of ours carries its creator's pid (``batchgen_a2a_<token>_pid<pid>_...``). A
    rank unlinks its files one op after making them and at exit, but a rank killed by SIGKILL
    between the two leaves them, and ``/dev/shm`` is memory: without a sweep, every killed
    rank could leave up to two segments (64 MiB each at the cap) until the machine reboots.
    `make_transport` sweeps at every start-up. A file whose pid runs (perhaps a reused pid) or
    that another user owns is kept; files named before pids were added are not recognised.

    Returns:
        The names removed.
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        match = _STALE.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.stat(path).st_uid == uid:
                os.unlink(path)
                removed.append(name)
        except OSError:  # gone already (another rank swept it) or not ours to remove
            pass
    return removed


def shm_room(world: int, cap: int, shm_dir: str = SHM_DIR) -> str | None:
    """Why ``shm_dir`` cannot hold the group's segments at the cap, or None when it can.

    The worst case is every rank of the group with both its segments at the cap: ``world x 2 x
    cap`` bytes (the header is a few KiB). A container's ``/dev/shm`` is often 64 MiB (Docker's
    default), where a segment growing mid-job would fail; checking at start-up lets the
    automatic choice take gloo instead.
    """
    try:
        st = os.statvfs(shm_dir)
    except OSError as exc:
        return f"cannot read the free space of {shm_dir} ({exc})"
    free, need = st.f_bavail * st.f_frsize, world * 2 * cap
    if free >= need:
        return None
    return (
        f"{shm_dir} has {free / (1 << 20):.0f} MiB free and the group may need "
        f"{need / (1 << 20):.0f} MiB ({world} ranks x 2 segments x {cap / (1 << 20):g} MiB, "
        f"{SEGMENT_MB_ENV})"
    )


class _Segment:
    """One mapped ``/dev/shm`` file as a ``uint8`` tensor."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)  # fail now, not SIGBUS on first touch
                except OSError as exc:
                    os.unlink(path)
                    raise RuntimeError(
                        f"cannot reserve {size} bytes in {SHM_DIR} for the all-to-all ({exc}); "
                        f"enlarge {SHM_DIR} or set {TRANSPORT_ENV}=gloo"
                    ) from exc
            else:
                size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.size = path, size
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        del self.tensor
        try:
            self.map.close()
        except BufferError:  # a tensor view still alive elsewhere: the GC unmaps it later
            pass


class ShmAllToAll:
    """All-to-all through shared memory among the ranks of one host (module docstring).

    Args:
        prefix: path prefix of this group's files (``/dev/shm/batchgen_a2a_<token>``).
        rank / world: this rank's index in the group and the group size.
        pids: every rank's process id, by group rank.
        header: the mapped shared header (`ShmAllToAll.header_bytes`).
        timeout_s: the longest wait for a peer before `all_to_all` raises.
        max_segment_bytes: the cap on one segment; None: ``$BATCHGEN_A2A_SHM_SEGMENT_MB``
            MiB, else `MAX_SEGMENT_BYTES`. Every rank of the group must use the same value.
    Raises:
        ValueError: a cap below 4 KiB, or a non-numeric ``$BATCHGEN_A2A_SHM_SEGMENT_MB``.
    """

    name = "shm"

    def __init__(
        self, prefix, rank, world, pids, header: _Segment, timeout_s: float,
        max_segment_bytes: int | None = None,
    ) -> None:
        self.prefix, self.rank, self.world, self.pids = prefix, rank, world, pids
        self.header, self.timeout_s = header, timeout_s
        self.max_segment_bytes = _segment_cap(max_segment_bytes)
        self.row = _HEAD + 2 * (world + 2)
        self.words = memoryview(header.map).cast("q")  # [world * row] int64
        self.seq = 0
        self.own: list[_Segment | None] = [None, None]  # my segments, by parity
        self.peers: dict[tuple[int, int], tuple[int, _Segment]] = {}  # (rank, parity) -> gen
        self._to_unlink: list[tuple[int, str]] = []  # (op that created it, path)
        self.words[rank * self.row + 1] = os.getpid()
        atexit.register(self._unlink, float("inf"))  # an error ended the rank: no stray files

    @staticmethod
    def header_bytes(world: int) -> int:
        return world * (_HEAD + 2 * (world + 2)) * 8

    def _word(self, rank: int, i: int) -> int:
        return self.words[rank * self.row + i]

    def _own_segment(self, parity: int, nbytes: int) -> _Segment:
        seg = self.own[parity]
        if seg is not None and seg.size >= nbytes:
            return seg
        gen = self._word(self.rank, 2 + parity) + 1
        size = max(MIN_SEGMENT_BYTES, nbytes + nbytes // 2, 2 * (seg.size if seg else 0))
        size = min(size, max(self.max_segment_bytes, nbytes))
        path = f"{self.prefix}_pid{os.getpid()}_r{self.rank}_p{parity}_g{gen}"
        new = _Segment(path, size, create=True)
        self._to_unlink.append((self.seq, path))
        if seg is not None:
            seg.close()
        self.own[parity] = new
        self.words[self.rank * self.row + 2 + parity] = gen
        return new

    def _peer_segment(self, src: int, parity: int) -> _Segment:
        gen = self._word(src, 2 + parity)
        cached = self.peers.get((src, parity))
        if cached is not None and cached[0] == gen:
            return cached[1]
        if cached is not None:
            cached[1].close()
        name = f"{self.prefix}_pid{self.pids[src]}_r{src}_p{parity}_g{gen}"
        seg = _Segment(name, 0, create=False)
        self.peers[(src, parity)] = (gen, seg)
        return seg

    def _wait(self, src: int, seq: int) -> None:
        """Until rank ``src`` published op ``seq``; RuntimeError naming it when it died or the
        timeout passed."""
        idx = src * self.row
        words = self.words
        if words[idx] >= seq:
            return
        start = time.monotonic()
        check = start + LIVENESS_EVERY_S
        sleep = 1e-6
        while words[idx] < seq:
            now = time.monotonic()
            waited = now - start
            if waited < SPIN_S:
                continue
            if waited < YIELD_S:
                os.sched_yield()
                continue
            time.sleep(sleep)
            sleep = min(MAX_SLEEP_S, sleep * 2)
            if now >= check:
                check = now + LIVENESS_EVERY_S
                if not _alive(self.pids[src]) and words[idx] < seq:
                    raise RuntimeError(
                        f"shared-memory all-to-all: rank {src} of the expert-parallel group "
                        f"(pid {self.pids[src]}) died before op {seq}"
                    )
                if waited > self.timeout_s:
                    raise RuntimeError(
                        f"shared-memory all-to-all: rank {src} of the expert-parallel group did "
                        f"not arrive at op {seq} within {self.timeout_s:.0f} s "
                        "(distributed_timeout_s)"
                    )

    def all_to_all(self, recv, send, recv_counts: list[int], send_counts: list[int]) -> None:
        """As `GlooAllToAll.all_to_all`, in as many rounds as the largest chunk needs under
        the segment cap (module docstring). Raises RuntimeError naming a peer rank that died
        or did not arrive within the timeout, or whose chunk for this rank has another size
        than ``recv_counts`` says (the ranks disagree: a bug)."""
        send_b = send.contiguous().view(-1).view(torch.uint8)
        recv_b = recv.view(-1).view(torch.uint8)
        row_bytes = math.prod(send.shape[1:]) * send.element_size()
        w = self.world
        quota = max(1, self.max_segment_bytes // (w * row_bytes)) if row_bytes else 1 << 62
        mine = max([-(-c // quota) for c in send_counts + recv_counts] + [1])
        send_at, recv_at = [0], [0]
        for c in send_counts:
            send_at.append(send_at[-1] + c * row_bytes)
        for c in recv_counts:
            recv_at.append(recv_at[-1] + c * row_bytes)
        rounds = self._round(send_b, recv_b, row_bytes, send_counts, recv_counts, send_at,
                             recv_at, 0, quota, mine)
        for j in range(1, rounds):
            self._round(send_b, recv_b, row_bytes, send_counts, recv_counts, send_at, recv_at,
                        j, quota, mine)

    def _round(
        self, send_b, recv_b, row_bytes, send_counts, recv_counts, send_at, recv_at, j, quota,
        mine,
    ) -> int:
        """Round ``j`` of an all-to-all (one op): rows ``[j q, (j + 1) q)`` of each pair, ``q =
        quota``. Returns the rounds the whole group needs (the largest figure the peers
        published; read in round 0)."""
        self.seq += 1
        seq, parity, w = self.seq, self.seq % 2, self.world
        self._unlink(before=seq - 1)
        lo_rows = [min(j * quota, c) for c in send_counts]
        hi_rows = [min((j + 1) * quota, c) for c in send_counts]
        nbytes = sum(h - lo for lo, h in zip(lo_rows, hi_rows)) * row_bytes
        seg = self._own_segment(parity, nbytes)
        base = self.rank * self.row + _HEAD + parity * (w + 2)
        offset = 0
        for d in range(w):
            self.words[base + d] = offset
            n = (hi_rows[d] - lo_rows[d]) * row_bytes
            if n:
                src_at = send_at[d] + lo_rows[d] * row_bytes
                seg.tensor[offset : offset + n].copy_(send_b[src_at : src_at + n])
            offset += n
        self.words[base + w] = offset
        self.words[base + w + 1] = mine
        self.words[self.rank * self.row] = seq  # publish: data and offsets are in place
        rounds = mine
        for step in range(w):
            src = (self.rank + step) % w
            lo_r = min(j * quota, recv_counts[src])
            want = (min((j + 1) * quota, recv_counts[src]) - lo_r) * row_bytes
            at = recv_at[src] + lo_r * row_bytes
            if src == self.rank:
                lo = self.words[base + src]
                if want:
                    recv_b[at : at + want].copy_(seg.tensor[lo : lo + want])
                continue
            self._wait(src, seq)
            peer = self._peer_segment(src, parity)
            pbase = src * self.row + _HEAD + parity * (w + 2)
            lo, hi = self.words[pbase + self.rank], self.words[pbase + self.rank + 1]
            rounds = max(rounds, self.words[pbase + w + 1])
            if hi - lo != want:
                raise RuntimeError(
                    f"shared-memory all-to-all op {seq}: rank {src} sent {hi - lo} bytes to rank "
                    f"{self.rank}, which expected {want}"
                )
            if want:
                recv_b[at : at + want].copy_(peer.tensor[lo:hi])
        return rounds

    def _unlink(self, before: float) -> None:
        """Remove the files this rank created at ops ``< before``. At the start of op ``n``
        every peer has mapped the segments of op ``n - 2``: this rank saw each peer publish
        op ``n - 1``, which a peer does only after reading op ``n - 2`` (the mapping keeps the
        memory after the unlink)."""
        keep = []
        for op, path in self._to_unlink:
            if op < before:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            else:
                keep.append((op, path))
        self._to_unlink = keep

    def close(self) -> None:
        """Unmap everything and remove this rank's files (safe to call twice)."""
        self._unlink(before=float("inf"))
        for seg in self.own:
            if seg is not None:
                seg.close()
        for _, seg in self.peers.values():
            seg.close()
        self.own, self.peers = [None, None], {}
        if self.words is not None:
            self.words.release()
            self.words = None
            self.header.close()


def _segment_cap(max_segment_bytes: int | None) -> int:
    """The segment cap in bytes: the argument, else ``$BATCHGEN_A2A_SHM_SEGMENT_MB`` MiB, else
    `MAX_SEGMENT_BYTES`. Raises ValueError below 4 KiB or on a non-numeric variable."""
    if max_segment_bytes is None:
        raw = os.environ.get(SEGMENT_MB_ENV)
        try:
            max_segment_bytes = int(float(raw) * (1 << 20)) if raw else MAX_SEGMENT_BYTES
        except ValueError:
            raise ValueError(f"${SEGMENT_MB_ENV} must be a number of MiB, got {raw!r}") from None
    if max_segment_bytes < 4096:
        raise ValueError(
            f"the shared-memory segment cap must be at least 4096 bytes "
            f"(${SEGMENT_MB_ENV} >= 0.004), got {max_segment_bytes}"
        )
    return max_segment_bytes


def __getattr__(name: str):
    """The transport choice moved to `batchgen.distributed.transport`; its names stay
    importable from here (lazily: that module imports this one)."""
    if name in ("GlooAllToAll", "make_transport"):
        from batchgen.distributed import transport

        return getattr(transport, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
