"""Ranks as Ray actors (``--distributed-executor-backend ray``, vLLM's name): one actor per
rank, placed by a placement group, each running the same `rank_main` as a rank process.

How a job starts:

1. Join Ray: the cluster at ``$RAY_ADDRESS``, or the one this process has joined already
   (``ray.init(...)`` before BatchGen); else start a local instance, which `close` stops again
   (a cluster BatchGen joined is left running).
2. A placement group of one bundle per rank, ``{"CPU": c}`` on CPU (``c``: the free CPUs over
   the ranks, at least 1) or ``{"GPU": 1, "CPU": 1}`` on CUDA, strategy PACK: fill a node
   before the next, so one machine works and an expert-parallel group shares nodes where it
   fits. The ranks of one node number themselves 0, 1, ... in bundle order (``local_rank``).
3. One actor per bundle. Its ``run`` calls `rank_main` with the frontend's address (the
   driver node's IP), port and key (an argument: never on a command line). Each rank
   connects, reports its Ray node id, and rank 0 hosts the ``torch.distributed`` rendezvous on
   its own node, at the address the frontend saw it connect from, as ranks of other machines
   do (`RankSet._init_method`).

Ray gives each GPU actor its own GPU in ``CUDA_VISIBLE_DEVICES`` (so a rank uses ``cuda:0``) and
sets ``OMP_NUM_THREADS`` to each actor's CPUs, which `configure_cpu_threads` takes as the rank's
torch threads. A dead actor shows to the frontend as its connection closing; `RayRankProcess`
adds Ray's reason. Shutdown kills the actors and removes the placement group.
"""

from __future__ import annotations

import logging
import os

from batchgen.config import EngineConfig, ParallelConfig
from batchgen.distributed.rank_process import describe_exit

logger = logging.getLogger(__name__)

LOCAL_OBJECT_STORE_BYTES = 128 * 2**20  # ranks pass nothing through Ray's object store
PLACEMENT_LOG_S = 10.0


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: pip install 'batchgen[ray]'"
        ) from None
    return ray


class RankActor:
    """One rank in a Ray actor's process (made a Ray actor class by `RayExecutor.start`)."""

    def __init__(self) -> None:
        from batchgen.engine.cpu_threads import set_openmp_wait_policy

        set_openmp_wait_policy()  # before this process loads torch (and libgomp with it)

    def run(self, launch) -> int:
        """`rank_main` until the frontend says stop; returns its exit code."""
        import ray

        from batchgen.distributed.worker import rank_main

        launch.node_id = ray.get_runtime_context().get_node_id()
        return rank_main(launch)


class RayRankProcess:
    """A rank's actor and the pending result of its ``run`` (the rank's exit code)."""

    def __init__(self, actor, result) -> None:
        self.actor, self.result = actor, result
        self.name = f"Ray actor {actor._actor_id.hex()[:8]}"
        self.pid = 0  # the actor's process id is known once the rank says `Hello`

    def done(self) -> bool:
        return self.wait(0)

    def describe(self) -> str:
        import ray

        if not self.wait(2.0):  # its socket closes a moment before Ray notices the death
            return "its connection closed (its Ray actor is still alive)"
        try:
            return describe_exit(ray.get(self.result, timeout=1.0))
        except ray.exceptions.RayActorError as exc:
            return f"its Ray actor died: {_reason(exc)}"
        except Exception as exc:  # noqa: BLE001  (Ray shut down meanwhile, ...)
            return f"its Ray actor ended: {type(exc).__name__}"

    def killed(self) -> bool:
        """Its actor died of a system failure (killed, its process or node lost), not of an
        error in its creation task nor by returning an exit code."""
        import ray

        if not self.wait(0):
            return False
        try:
            ray.get(self.result, timeout=1.0)
        except ray.exceptions.RayActorError as exc:
            return not getattr(exc, "actor_init_failed", False)
        except Exception:  # noqa: BLE001  (Ray shut down meanwhile, a task error, ...)
            return False
        return False

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001  (dead already, or Ray shut down)
            pass

    def wait(self, timeout: float) -> bool:
        import ray

        try:
            ready, _ = ray.wait([self.result], timeout=timeout)
        except Exception:  # noqa: BLE001  (Ray shut down: nothing of it is left running)
            return True
        return bool(ready)


def _reason(exc: Exception) -> str:
    """Ray's sentence on why an actor died (``The actor is dead because it was killed by
    `ray.kill`.``), else the error's first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    because = [line for line in lines if "because" in line and "actor" in line.lower()]
    return (because or lines or [type(exc).__name__])[-1]


class RayExecutor:
    """Join or start Ray and reserve one bundle per rank (see the module docstring).

    Raises:
        ImportError: Ray is not installed.
        RuntimeError: the cluster cannot place the ranks within ``distributed_timeout_s``.
    """

    def __init__(self, config: EngineConfig, parallel: ParallelConfig) -> None:
        ray = _import_ray()
        self.world = parallel.data_parallel_size
        self.started_ray = False
        self.pg = None
        self.processes: list[RayRankProcess] = []
        self._closed = False
        if not ray.is_initialized():
            self._init_ray(ray)
        try:
            self.gpu = config.device == "cuda" or (
                config.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1
            )
            free_cpus = int(ray.available_resources().get("CPU", self.world))
            self.cpus_per_rank = 1 if self.gpu else max(1, free_cpus // self.world)
            self.bundle = {"GPU": 1, "CPU": 1} if self.gpu else {"CPU": self.cpus_per_rank}
            self.node_of_rank = self._place(ray, parallel.distributed_timeout_s)
            default = ParallelConfig().data_parallel_address
            self.driver_address = (
                parallel.data_parallel_address
                if parallel.data_parallel_address != default
                else ray.util.get_node_ip_address()
            )
        except BaseException:
            self.close()
            raise

    def _init_ray(self, ray) -> None:
        if os.environ.get("RAY_ADDRESS"):
            logger.info("joining the Ray cluster at $RAY_ADDRESS=%s", os.environ["RAY_ADDRESS"])
            ray.init(log_to_driver=True)
            return
        from batchgen.engine.cpu_threads import available_cpus

        cpus = max(available_cpus(), self.world)
        logger.info("starting a local Ray instance with %d CPUs", cpus)
        ray.init(
            num_cpus=cpus,
            include_dashboard=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            log_to_driver=True,
        )
        self.started_ray = True

    def _place(self, ray, timeout: float) -> list[str]:
        """Reserve the bundles; returns the node id of each rank's bundle."""
        from ray.util.placement_group import placement_group, placement_group_table

        self.pg = placement_group([dict(self.bundle)] * self.world, strategy="PACK")
        waited = 0.0
        while not ray.wait([self.pg.ready()], timeout=PLACEMENT_LOG_S)[0]:
            waited += PLACEMENT_LOG_S
            if waited >= timeout:
                raise RuntimeError(
                    f"Ray could not place {self.world} ranks of {self.bundle} each within "
                    f"{timeout:.0f} s (distributed_timeout_s); the cluster has "
                    f"{ray.cluster_resources()} of which {ray.available_resources()} are free"
                )
            logger.info("waiting for Ray to place %d ranks of %s", self.world, self.bundle)
        nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        return [nodes[i] for i in range(self.world)]

    def _refresh_nodes(self) -> None:
        """Re-read where each bundle lives: Ray re-places the bundles of a lost node, so a
        rank started again may land on another node (and take another ``local_rank``). A
        bundle not placed yet keeps its last node; its actor waits for the placement."""
        from ray.util.placement_group import placement_group_table

        try:
            nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        except Exception as e:  # noqa: BLE001  (the GCS is briefly unreachable)
            logger.warning("could not re-read the placement group: %s", e)
            return
        self.node_of_rank = [nodes.get(i) or n for i, n in enumerate(self.node_of_rank)]

    def start(
        self, address: str, port: int, authkey: bytes, ranks: list[int] | None = None
    ) -> dict[int, RayRankProcess]:
        """One actor per rank (or for ``ranks`` only: started again after a failure, in their
        own bundles of the placement group, which Ray re-places if their node was lost),
        joining the frontend at ``address:port`` with ``authkey``."""
        ray = _import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from batchgen.distributed.worker import RankLaunch

        actor_class = ray.remote(RankActor)
        out: dict[int, RayRankProcess] = {}
        if ranks is not None:
            self._refresh_nodes()
        for r, node in enumerate(self.node_of_rank):
            if ranks is not None and r not in ranks:
                continue
            same_node = [i for i, n in enumerate(self.node_of_rank) if n == node]
            actor = actor_class.options(
                num_cpus=self.bundle["CPU"],
                num_gpus=self.bundle.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=r
                ),
            ).remote()
            launch = RankLaunch(
                r,
                same_node.index(r),
                len(same_node),
                address,
                port,
                authkey,
                cuda_device=0 if self.gpu else None,
            )
            out[r] = RayRankProcess(actor, actor.run.remote(launch))
            self.processes.append(out[r])
        logger.info(
            "started %d rank actor(s) on %d Ray node(s)", len(out), len(set(self.node_of_rank))
        )
        return out

    def close(self) -> None:
        """Kill the actors, remove the placement group, and stop Ray if BatchGen started it.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        import ray

        if not ray.is_initialized():
            return
        for proc in self.processes:
            proc.kill()
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001  (removed already)
                pass
        if self.started_ray:
            ray.shutdown()
