"""Ranks as Ray actors (``distributed_executor_backend='ray'``): a local Ray instance started
by BatchGen, a two-node cluster simulated on this machine (`ray.cluster_utils.Cluster`), a bad
backend name and an actor killed mid-job.

Every case has a timeout and leaves no Ray behind: BatchGen stops the instance it started, the
test stops the cluster it made.
"""

from __future__ import annotations

import random
import time

import pytest

from batchgen import LLM, SamplingParams
from batchgen.config import ParallelConfig

ray = pytest.importorskip("ray")

ARCH = "qwen2_moe"
KV_BLOCKS = 12  # small enough that the ranks preempt


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 70, 17, 40, 1, 25)]


def _params() -> list[SamplingParams]:
    greedy = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)
    ]
    return greedy + [SamplingParams(max_tokens=9, temperature=0.9, seed=5, n=2, ignore_eos=True)]


def _run(llm: LLM) -> list[list[list[int]]]:
    outs = llm.generate(_prompts(), _params(), use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _two_ranks(model: str, backend: str) -> LLM:
    return LLM(
        model,
        num_gpu_blocks_override=KV_BLOCKS,
        data_parallel_size=2,
        enable_expert_parallel=True,
        distributed_executor_backend=backend,
    )


@pytest.fixture(scope="module")
def one_process(checkpoint_dir):
    return _run(LLM(str(checkpoint_dir(ARCH)), num_gpu_blocks_override=KV_BLOCKS))


@pytest.fixture(autouse=True)
def no_ray_left():
    assert not ray.is_initialized()
    yield
    if ray.is_initialized():  # a failed test: do not leak Ray into the next one
        ray.shutdown()
        pytest.fail("Ray was left running")


@pytest.mark.timeout(300)
def test_local_ray_matches_mp_and_one_process(checkpoint_dir, one_process):
    """Two expert-parallel ranks as actors of a local Ray instance that BatchGen starts (and
    stops): token for token what the mp executor and one process produce."""
    model = str(checkpoint_dir(ARCH))
    llm = _two_ranks(model, "mp")
    try:
        by_mp = _run(llm)
    finally:
        llm.shutdown()
    started = time.monotonic()
    llm = _two_ranks(model, "ray")
    try:
        assert ray.is_initialized()  # BatchGen started it (no $RAY_ADDRESS in tests)
        by_ray = _run(llm)
        ranks = llm.get_metrics()["ranks"]
    finally:
        llm.shutdown()
    print(f"ray job: {time.monotonic() - started:.1f} s")
    assert not ray.is_initialized(), "BatchGen must stop the Ray instance it started"
    assert by_ray == by_mp == one_process
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["node_id"] for r in ranks}) == 1  # one machine, one node
    assert all(r["generated_tokens"] > 0 for r in ranks)


@pytest.mark.timeout(300)
def test_two_node_simulation_places_one_rank_per_node(checkpoint_dir, one_process):
    """A cluster of two 1-CPU nodes on this machine: PACK cannot fit two 1-CPU ranks on one
    node, so each node gets one; the job joins the cluster (and leaves it running)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "object_store_memory": 80 * 2**20,
        },
    )
    try:
        cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
        ray.init(address=cluster.address)
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        llm = _two_ranks(str(checkpoint_dir(ARCH)), "ray")
        try:
            got = _run(llm)
            ranks = llm.get_metrics()["ranks"]
        finally:
            llm.shutdown()
        assert ray.is_initialized(), "a joined cluster must be left running"
        assert got == one_process
        assert {r["node_id"] for r in ranks} == nodes  # one rank on each node
        deadline = time.monotonic() + 20  # Ray frees the bundles asynchronously
        while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU") == 2, "actors or bundles left behind"
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.timeout(30)
def test_bad_backend_is_refused():
    with pytest.raises(ValueError, match=r"distributed_executor_backend must be one of \('mp'"):
        ParallelConfig(data_parallel_size=2, distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="data_parallel_size_local=1 cannot be combined"):
        ParallelConfig(
            data_parallel_size=2, data_parallel_size_local=1, distributed_executor_backend="ray"
        )


@pytest.mark.timeout(300)
def test_killed_actor_is_named(checkpoint_dir):
    """``ray.kill`` on rank 1's actor mid-job: the frontend names rank 1 and Ray's reason, the
    job ends with RankFailedError and nothing hangs."""
    from batchgen.distributed.rank_set import RankFailedError

    llm = _two_ranks(str(checkpoint_dir(ARCH)), "ray")
    try:
        engine = llm.llm_engine
        for i in range(8):
            params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            engine.add_request(f"r{i}", f"request {i} " * 4, params, data_parallel_rank=i % 2)
        engine.step()
        ray.kill(engine.rank_set.ranks[1].process.actor)
        killed = time.monotonic()
        with pytest.raises(RankFailedError) as info:
            while time.monotonic() - killed < 60:
                engine.step()
        assert time.monotonic() - killed < 30
    finally:
        llm.shutdown()
    assert info.value.ranks == [1], str(info.value)
    text = str(info.value)
    assert "rank 1 (" in text and "Ray node" in text
    assert "its Ray actor died" in text and "ray.kill" in text, text


@pytest.mark.timeout(300)
def test_killed_actor_is_recovered(checkpoint_dir, one_process):
    """With elastic recovery, ``ray.kill`` on rank 1's actor mid-job starts new actors and
    re-queues the unfinished requests: every request answered once, one process's tokens."""
    llm = LLM(
        str(checkpoint_dir(ARCH)),
        num_gpu_blocks_override=KV_BLOCKS,
        data_parallel_size=2,
        enable_expert_parallel=True,
        distributed_executor_backend="ray",
        enable_elastic_recovery=True,
    )
    try:
        engine = llm.llm_engine
        for i, (prompt, params) in enumerate(zip(_prompts(), _params(), strict=True)):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        got = {out.request_id: out for out in engine.step()}
        ray.kill(engine.rank_set.ranks[1].process.actor)
        deadline = time.monotonic() + 180
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the job did not finish: a hang"
            for out in engine.step():
                assert out.request_id not in got, f"{out.request_id} answered twice"
                got[out.request_id] = out
        assert engine.recovery.recoveries == 1
    finally:
        llm.shutdown()
    assert [[c.token_ids for c in got[f"r{i}"].outputs] for i in range(6)] == one_process


@pytest.mark.timeout(300)
def test_killed_actor_alone_is_replaced_while_the_other_runs_on(checkpoint_dir, one_process):
    """Replicated experts: each rank is its own restart group, so ``ray.kill`` on rank 1's
    actor starts one new actor (in rank 1's bundle) and rank 0's actor runs on."""
    llm = LLM(
        str(checkpoint_dir(ARCH)),
        num_gpu_blocks_override=KV_BLOCKS,
        data_parallel_size=2,
        distributed_executor_backend="ray",
        enable_elastic_recovery=True,
    )
    try:
        engine = llm.llm_engine
        for i, (prompt, params) in enumerate(zip(_prompts(), _params(), strict=True)):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        got = {out.request_id: out for out in engine.step()}
        before = [r.pid for r in engine.rank_set.ranks]
        ray.kill(engine.rank_set.ranks[1].process.actor)
        deadline = time.monotonic() + 180
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the job did not finish: a hang"
            for out in engine.step():
                assert out.request_id not in got, f"{out.request_id} answered twice"
                got[out.request_id] = out
        assert engine.recovery.recoveries == 1
        after = [r.pid for r in engine.rank_set.ranks]
        assert after[0] == before[0] and after[1] != before[1]
    finally:
        llm.shutdown()
    assert [[c.token_ids for c in got[f"r{i}"].outputs] for i in range(6)] == one_process
