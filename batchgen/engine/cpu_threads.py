"""CPU threads: how many torch and the OpenMP kernels use, and what their idle threads do.

Two settings, made once per process:

- **How many.** ``cpus // num_local_processes`` threads (at least 1), where ``cpus`` is the
  number of CPUs this process may run on: its affinity mask (``os.sched_getaffinity``: taskset,
  cpusets, container CPU pinning), capped by a cgroup v2 CPU quota (``cpu.max``) when one is
  set. A data-parallel launcher that starts N rank processes on one machine passes N, so the
  ranks do not fight over cores. ``OMP_NUM_THREADS`` set by the user wins.
- **What idle threads do.** GNU OpenMP (the ``libgomp`` that torch's CPU wheels and our C++
  kernels use) lets a thread that reaches a barrier spin for about 300,000 iterations (tens of
  milliseconds) before it sleeps. On idle cores that saves a wake-up; beside another busy
  process it burns the time slices the straggling thread needs, and a step can take tens of
  times longer. `set_openmp_wait_policy` bounds the spin: on a machine already busy when
  BatchGen starts (another task running: the run queue, sampled for 200 ms) threads sleep at once
  (``OMP_WAIT_POLICY=PASSIVE``, the largest gain there); on an idle one they spin at most
  10,000 iterations (``GOMP_SPINCOUNT``: under a millisecond, which keeps the idle speed and
  limits the loss if load arrives later). Measured with `benchmarks/cpu_threads.py`. The
  user's choice wins: nothing is set when ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or
  ``KMP_BLOCKTIME`` (Intel's OpenMP) is set. libgomp reads these variables once, when it is
  loaded with torch, so the command line sets them before it imports torch; in a process that
  has imported torch already they only reach child processes.

`configure_cpu_threads` logs the choice at engine start and warns once when other processes
already keep as many tasks running as there are CPUs (`warn_if_oversubscribed`: the run queue
now, not the 1-minute load average, which stays high after any earlier run).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

# Variables that decide how long an idle OpenMP thread spins; any one set means the user chose.
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
BUSY_WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}  # another process is already running
IDLE_WAIT_POLICY = {"GOMP_SPINCOUNT": "10000"}
BUSY_LOAD = 1.0  # where the run queue cannot be read: a 1-minute load average this high is busy
RUN_QUEUE_SAMPLES, RUN_QUEUE_INTERVAL_S = 21, 0.01  # `running_tasks`: 21 reads over 200 ms

_configured: int | None = None  # threads chosen by `configure_cpu_threads` in this process
_warned_oversubscribed = False


def available_cpus(cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """CPUs this process may use: the size of its affinity mask, capped by the cgroup v2 CPU
    quota (``cpu.max``: ``quota period`` in microseconds, or ``max`` for none), rounded up."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = (Path(cgroup_root) / "cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def own_running_threads(tasks: str | Path = "/proc/self/task") -> int:
    """Threads of this process running or runnable now (state ``R`` in their
    ``/proc/self/task/<tid>/stat``), the caller included: at least 1 (1 where unreadable)."""
    count = 0
    try:
        for stat_file in Path(tasks).glob("*/stat"):
            try:
                text = stat_file.read_text()
            except OSError:  # the thread ended
                continue
            fields = text.rsplit(")", 1)[-1].split()  # the name may hold spaces and ")"
            count += bool(fields) and fields[0] == "R"
    except OSError:
        return 1
    return max(1, count)


def running_tasks(
    loadavg: str | Path = "/proc/loadavg",
    samples: int = RUN_QUEUE_SAMPLES,
    interval_s: float = RUN_QUEUE_INTERVAL_S,
    own: Callable[[], int] = own_running_threads,
) -> int | None:
    """Tasks of other processes running or runnable now: the median over ``samples`` reads,
    ``interval_s`` apart, of ``/proc/loadavg``'s fourth field (``running/total``, threads of
    the whole machine, the reader included) less this process's running threads (``own``: the
    reader, and any of its threads at work). None where the file cannot be read (not Linux)."""
    import time

    counts = []
    for i in range(samples):
        try:
            running = int(Path(loadavg).read_text().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        counts.append(running - own())
        if i + 1 < samples:
            time.sleep(interval_s)
    return max(0, sorted(counts)[len(counts) // 2])


def set_openmp_wait_policy(
    environ: dict | None = None, load: float | None = None, running: int | None = None
) -> dict:
    """Bound how long idle OpenMP threads spin: `BUSY_WAIT_POLICY` (sleep at once) when the
    machine is busy, else `IDLE_WAIT_POLICY` (a short spin); nothing when one of
    `WAIT_POLICY_VARS` is set already (the user's choice wins).

    Busy means another task is running now (`running_tasks`: the run queue, sampled for 200 ms,
    so that a process still exiting, such as the engine a benchmark ran just before, is not taken
    for a competitor (a bf16 peer run with a 40 ms window chose sleeping threads on an idle
    machine and ran at 1,578 tokens/s, a later one that chose spinning at 1,992, 2026-12-02).
    Not the 1-minute load average, which stays above 1 on 2 cores for a minute or two after any
    earlier job: after a benchmark run it chose sleeping threads on an idle machine, and those
    cost 5-28% (`batchgen bench` rollouts, docs/performance.md). The load average decides only
    where the run queue cannot be read.

    Takes effect only in a process that has not loaded torch yet (and in its children).

    Args:
        environ: the environment to change (default ``os.environ``).
        load: a 1-minute load average to judge instead (`BUSY_LOAD` or more is busy); used
            when given and ``running`` is not.
        running: other tasks running now (default `running_tasks`); 1 or more is busy.
    Returns:
        The variables set (empty when the user had chosen).
    """
    env = os.environ if environ is None else environ
    if any(name in env for name in WAIT_POLICY_VARS):
        return {}
    if running is None and load is None:
        running = running_tasks()
    if running is not None:
        busy = running >= 1
    else:
        if load is None:
            try:
                load = os.getloadavg()[0]
            except OSError:
                load = 0.0
        busy = load >= BUSY_LOAD
    policy = BUSY_WAIT_POLICY if busy else IDLE_WAIT_POLICY
    env.update(policy)
    return dict(policy)


def user_omp_num_threads() -> int | None:
    """The threads ``OMP_NUM_THREADS`` asks for: its outer level (OpenMP's syntax is a list of
    positive ints, one per nesting level: ``4,2`` means 4), None when unset or blank.

    Raises:
        ValueError: a value that is not such a list, naming the variable and its form.
    """
    raw = os.environ.get("OMP_NUM_THREADS", "")
    levels = [level.strip() for level in raw.split(",")] if raw.strip() else []
    if levels and not all(lv.isascii() and lv.isdigit() and int(lv) > 0 for lv in levels):
        raise ValueError(
            f"OMP_NUM_THREADS={raw!r}: expected a positive int (or OpenMP's comma-separated "
            "list of them, one per nesting level), or unset"
        )
    return int(levels[0]) if levels else None


def configure_cpu_threads(num_local_processes: int | None = None) -> int:
    """Set torch's intra-op threads for this process; returns their number.

    Args:
        num_local_processes: processes of this job sharing the machine's CPUs (a data-parallel
            launcher passes its ranks per machine); each gets ``available_cpus() // N``
            threads, at least 1. None keeps an earlier call's choice, else means 1.
    Raises:
        ValueError: ``num_local_processes`` < 1.

    ``OMP_NUM_THREADS`` set by the user wins over the computed number (`user_omp_num_threads`,
    which raises ValueError for a malformed value). The first call logs
    the number and the wait policy in force; it also warns, once per process, when other
    processes already keep the CPUs busy (`warn_if_oversubscribed`).
    """
    global _configured
    if num_local_processes is None:
        if _configured is not None:
            return _configured
        num_local_processes = 1
    if num_local_processes < 1:
        raise ValueError(f"num_local_processes must be >= 1, got {num_local_processes}")
    import torch

    cpus = available_cpus()
    user_threads = user_omp_num_threads()
    if user_threads is not None:
        threads = user_threads
        source = "OMP_NUM_THREADS"
    else:
        threads = max(1, cpus // num_local_processes)
        source = f"{cpus} CPUs available / {num_local_processes} local process(es)"
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    first = _configured is None
    _configured = threads
    if first:
        policy = ", ".join(f"{k}={os.environ[k]}" for k in WAIT_POLICY_VARS if k in os.environ)
        logger.info(
            "CPU threads: %d (%s); OpenMP wait policy: %s",
            threads,
            source,
            policy or "libgomp's default (spin, then sleep)",
        )
        warn_if_oversubscribed(cpus)
    return threads


def warn_if_oversubscribed(
    cpus: int | None = None, load: float | None = None, running: int | None = None
) -> bool:
    """Warn (once per process) when other processes keep at least ``cpus`` tasks running now:
    they then compete with every step for the cores. Returns whether it warned now.

    Judged by the run queue (`running_tasks`: sampled over 200 ms, this process's own threads
    left out), not the 1-minute load average: that one stays near the CPU count for a minute
    or two after any earlier run on an idle machine, and counts this process's own start-up
    work (building a model, compiling kernels), so it warned on quiet machines. The load
    average decides only where the run queue cannot be read (or when ``load`` is given).

    Args:
        cpus: CPUs of this process (default `available_cpus`).
        load: a 1-minute load average to judge instead (used when ``running`` is not given).
        running: other processes' running tasks (default `running_tasks`).
    """
    global _warned_oversubscribed
    if _warned_oversubscribed:
        return False
    cpus = cpus or available_cpus()
    if running is None and load is None:
        running = running_tasks()
    if running is not None:
        if running < cpus:
            return False
        what = f"{running} task(s) of other processes running now"
    else:
        if load is None:
            try:
                load = os.getloadavg()[0]
            except OSError:
                return False
        if load < cpus:
            return False
        what = f"load average {load:.1f} over the last minute"
    _warned_oversubscribed = True
    logger.warning(
        "the machine is busy: %s on %d CPU(s); other processes compete with BatchGen for the "
        "cores, so steps will be slower. Set OMP_NUM_THREADS to the cores that are actually "
        "free",
        what,
        cpus,
    )
    return True
