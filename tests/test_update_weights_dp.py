"""`LLM.update_weights` and `reset_prefix_cache` on data-parallel engines: every rank takes the
update (an expert-parallel rank only its experts), and the job then generates exactly what a
fresh single-process engine on the new checkpoint does; a bad update changes nothing on any
rank; a rank restarted after a failure applies the updates made since the start.

Every case carries a timeout and stops its rank processes before returning.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file
from test_update_weights import _hf_state_dict, _tokens, expected, paths  # noqa: F401

from batchgen import LLM, SamplingParams
from batchgen.distributed import protocol as msg
from batchgen.distributed.frontend import DPEngineClient


def _dp_llm(path, **kwargs) -> LLM:
    return LLM(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=16,
        kv_cache_memory_gb=0.05,
        data_parallel_size=2,
        **kwargs,
    )


@pytest.mark.timeout(300)
def test_expert_parallel_ranks_update_their_shards(paths, expected):  # noqa: F811
    """One expert-parallel group of 2 (each rank holds 2 of the 4 experts): A -> B from a
    trainer's state dict (fused expert tensors, sliced per rank) -> a bad update refused
    everywhere -> back to A from its directory (per-expert tensors, other ranks' skipped)."""
    a, b = paths
    out_a, out_b = expected
    llm = _dp_llm(a, enable_expert_parallel=True)
    try:
        assert [r.held_experts for r in llm.llm_engine.rank_set.ready] == [2, 2]
        assert _tokens(llm) == out_a
        state = _hf_state_dict(b)
        assert llm.update_weights(state) == len(state)  # every tensor copied by some rank
        assert _tokens(llm) == out_b

        bad = {**_hf_state_dict(a), "model.norm.weight": torch.zeros(3)}
        with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
            llm.update_weights(bad)
        assert _tokens(llm) == out_b  # nothing changed, on either rank

        engine = llm.llm_engine
        engine.add_request("busy", "Hello", SamplingParams(max_tokens=64, ignore_eos=True))
        with pytest.raises(RuntimeError, match="in flight"):
            llm.update_weights(a)
        assert not llm.reset_prefix_cache()
        engine.abort_request("busy")
        assert llm.reset_prefix_cache()

        assert llm.update_weights(a) == len(load_file(str(a / "model.safetensors")))
        assert _tokens(llm) == out_a
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.timeout(300)
def test_a_rank_restarted_after_an_update_runs_the_new_weights(paths, expected):  # noqa: F811
    """Replicated experts, elastic recovery: after A -> B, rank 1 is killed; its replacement
    loads A from disk, applies the update before it serves, and every answer is B's."""
    a, b = paths
    _, out_b = expected
    llm = _dp_llm(a, enable_elastic_recovery=True)
    engine = llm.llm_engine
    try:
        llm.update_weights(_hf_state_dict(b))
        assert len(engine.rank_set.weight_updates) == 1
        old = engine._ranks[1].pid
        os.kill(old, signal.SIGKILL)
        assert _tokens(llm) == out_b  # the failure is found and recovered meanwhile
        deadline = time.monotonic() + 120
        while engine.rank_set.joining or engine._ranks[1].pid in (old, 0):
            assert time.monotonic() < deadline, "rank 1 was not replaced"
            engine.get_metrics()  # takes the replacement's Ready in
        replacement, = [r for r in engine._ranks if r.rank == 1]
        before = replacement.done_tokens
        assert _tokens(llm) == out_b  # both ranks serve B: the replacement applied the update
        assert replacement.done_tokens > before  # it answered some of them
        assert engine.get_metrics()["recoveries"] == 1
    finally:
        engine.shutdown()


def test_later_full_updates_replace_earlier_ones_in_the_replay_list():
    """What a restarted rank replays stays about one model's size: a tensor update that names
    every tensor of an earlier one drops it; partial and path updates are kept in order."""
    client = DPEngineClient.__new__(DPEngineClient)
    client.rank_set = type("RankSet", (), {"weight_updates": []})()
    full = frozenset({"a", "b"})
    updates = client.rank_set.weight_updates

    def add(names, path=None):
        update = msg.UpdateWeights(-1, path=path, data=None if path else b"x")
        updates.append(update)
        if path is None:
            client._drop_covered(update, frozenset(names))
        return update

    first = add(full)
    second = add(full)
    assert updates == [second] and updates[0] is second and first is not second
    path = add((), path="/ckpt/step-1")
    partial = add({"a"})
    assert updates == [second, path, partial]
    last = add(full)
    assert updates == [path, last]


def test_offload_prefill_refuses_updates():
    """Ranks that stream other ranks' experts from their start checkpoint cannot take an
    update (checked before anything is sent)."""
    from batchgen.config import ParallelConfig

    client = DPEngineClient.__new__(DPEngineClient)
    client.parallel = ParallelConfig(
        data_parallel_size=2,
        enable_expert_parallel=True,
        prefill_strategy="data_parallel_offload",
    )
    client.requests, client._finished, client._fatal = {}, [], None
    client.rank_set = type("RankSet", (), {"closed": False, "failure": None})()
    with pytest.raises(NotImplementedError, match="data_parallel_offload"):
        client.update_weights({"model.norm.weight": torch.zeros(64)})
