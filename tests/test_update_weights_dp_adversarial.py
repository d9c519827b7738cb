"""Adversarial inputs for `LLM.update_weights` / `reset_prefix_cache` on data-parallel engines
(and the single-process engine they must agree with): odd tensors, bad paths, expert-parallel
shards named wrongly, a rank killed while an update is in flight.

Every multi-process case carries a timeout and stops its rank processes before returning.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from test_update_weights import _hf_state_dict, _llm, _tokens, expected, paths  # noqa: F401
from test_update_weights_dp import _dp_llm

from batchgen.distributed import protocol as msg
from batchgen.distributed.frontend import DPEngineClient
from batchgen.distributed.frontend_weights import _serialise

W1 = "model.layers.{}.block_sparse_moe.experts.{}.w1.weight"


# ---------------------------------------------------------------- no rank processes


def test_meta_tensor_is_refused_up_front_by_the_single_process_engine(paths):  # noqa: F811
    """A meta tensor (no data) passes the name/shape/dtype checks; the copy then fails after
    the tensors before it were written, breaking 'all or nothing'."""
    a, b = paths
    llm = _llm(a)
    before = {k: v.clone() for k, v in llm.llm_engine.runner.model.named_parameters()}
    state = _hf_state_dict(b)
    last = list(state)[-1]
    state[last] = torch.empty(state[last].shape, device="meta")
    with pytest.raises((ValueError, TypeError), match="meta"):
        llm.update_weights(state)
    after = dict(llm.llm_engine.runner.model.named_parameters())
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing changed


def test_meta_tensor_is_refused_with_its_name_by_the_frontend():
    with pytest.raises((ValueError, TypeError), match="model.norm.weight.*meta"):
        _serialise({"model.norm.weight": torch.empty(64, device="meta")})


def test_serialise_odd_tensors_round_trip():
    """Transposed views, one tensor under two names, slices of one storage, bf16/fp64, 0-dim
    and empty tensors, a generator of pairs: all arrive with their values."""
    from safetensors.torch import load

    base = torch.randn(6, 4, dtype=torch.float64)
    pairs = {
        "t": base.t(),  # non-contiguous
        "same1": base,
        "same2": base,  # one tensor, two names
        "row0": base[0],
        "row1": base[1],  # one storage, two offsets
        "bf": base.to(torch.bfloat16),
        "scalar": torch.tensor(3.0),
        "empty1": torch.empty(0),
        "empty2": torch.empty(0, 3),
    }
    data, names = _serialise((k, v) for k, v in pairs.items())
    assert names == frozenset(pairs)
    back = load(data)
    for k, v in pairs.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_duplicate_names_are_refused_like_the_single_process_engine():
    """A name given twice is refused by the frontend and by a single-process engine alike
    (before, a DP job kept the last copy and one process checked and wrote both)."""
    from batchgen.engine.weight_update import _tensor_sources

    twice = [("model.norm.weight", torch.zeros(3)), ("model.norm.weight", torch.ones(64))]
    with pytest.raises(ValueError, match="'model.norm.weight' appears twice"):
        _serialise(twice)
    with pytest.raises(ValueError, match="'model.norm.weight' appears twice"):
        list(_tensor_sources(twice))


def test_a_refused_repeat_of_an_earlier_update_keeps_the_earlier_one_in_the_replay_list():
    """update(P) ok, update(Q) ok, update(P) refused (say P was overwritten meanwhile): the
    replay list must stay [P, Q]. `list.remove` compares dataclasses by value and removed
    the first P, leaving [Q, P]: a restarted rank would end on P, the others on Q."""
    client = DPEngineClient.__new__(DPEngineClient)
    client.rank_set = type("RankSet", (), {"weight_updates": [], "closed": False})()
    client._check_idle = lambda what: None
    client.parallel = type("P", (), {"resolved_expert_parallel_size": 1,
                                     "prefill_strategy": "expert_parallel"})()
    replies = iter([
        [msg.Reply(0, 0, [])],
        [msg.Reply(0, 1, [])],
        [msg.Reply(0, 2, error="gone", error_type="ValueError")],
    ])
    client._call = lambda make: next(replies)
    client.update_weights("/ckpt/p")
    client.update_weights("/ckpt/q")
    with pytest.raises(ValueError, match="gone"):
        client.update_weights("/ckpt/p")
    assert [u.path for u in client.rank_set.weight_updates] == ["/ckpt/p", "/ckpt/q"]


# ---------------------------------------------------------------- rank processes


@pytest.mark.timeout(300)
def test_replicated_dp_odd_inputs(paths, expected, tmp_path, monkeypatch):  # noqa: F811
    """One replicated DP job: bad paths, empty updates, a generator of fp64 non-contiguous
    pairs, update after shutdown."""
    a, b = paths
    out_a, out_b = expected
    llm = _dp_llm(a)
    try:
        assert _tokens(llm) == out_a
        for bad in [tmp_path / "nope", a / "model.safetensors"]:
            with pytest.raises(ValueError, match="not a checkpoint directory"):
                llm.update_weights(bad)
        assert llm.update_weights({}) == 0
        assert llm.update_weights([]) == 0
        # the second empty update covers the first: at most one (no-op) replay entry
        assert len(llm.llm_engine.rank_set.weight_updates) <= 1
        # relative path (the ranks' working directory may differ: made absolute)
        monkeypatch.chdir(b.parent)
        assert llm.update_weights(b.name) > 0
        assert _tokens(llm) == out_b
        assert llm.update_weights(a) > 0
        state = _hf_state_dict(b)
        gen = ((k, v.double().t().contiguous().t() if v.dim() == 2 else v.double())
               for k, v in state.items())
        assert llm.update_weights(gen) == len(state)
        assert _tokens(llm) == out_b
        # bf16: the same as a single process given the same bf16 tensors
        bf = {k: v.to(torch.bfloat16) for k, v in _hf_state_dict(a).items()}
        single = _llm(b)
        single.update_weights(bf)
        llm.update_weights(bf)
        assert _tokens(llm) == _tokens(single)
    finally:
        llm.llm_engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.update_weights(a)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.reset_prefix_cache()


@pytest.mark.timeout(300)
def test_expert_parallel_bad_expert_tensors(paths, expected):  # noqa: F811
    """EP group of 2 (rank 0: experts 0,1; rank 1: 2,3)."""
    a, b = paths
    out_a, out_b = expected
    llm = _dp_llm(a, enable_expert_parallel=True)
    try:
        state_b = _hf_state_dict(b)
        shape = (32, 64)
        w1 = state_b["model.layers.0.mlp.experts.gate_up_proj"]
        with pytest.raises(ValueError, match="expert 4 does not exist"):
            llm.update_weights({W1.format(0, 4): torch.zeros(shape)})
        with pytest.raises(ValueError, match="has shape"):
            llm.update_weights({"model.layers.0.mlp.experts.gate_up_proj": w1[:3]})
        # only rank 1's experts: rank 0 copies nothing, still fine
        from safetensors.torch import load_file

        file_b = load_file(str(b / "model.safetensors"))
        other = {k: v for k, v in file_b.items() if ".experts.2." in k or ".experts.3." in k}
        assert llm.update_weights(other) == len(other)
        # a wrong shape on an expert only rank 1 holds, next to a good tensor rank 0 writes:
        # must fail on every rank and change nothing (not 'ranks disagree')
        bad = {"model.norm.weight": file_b["model.norm.weight"],
               W1.format(0, 3): torch.zeros(3, 3)}
        with pytest.raises(ValueError, match="experts.3.w1.weight"):
            llm.update_weights(bad)
        # finish on B everywhere, tokens equal one process on B
        assert llm.update_weights(b) > 0
        assert _tokens(llm) == out_b
    finally:
        llm.llm_engine.shutdown()


def _wait_replaced(engine, rank, old, timeout=120):
    deadline = time.monotonic() + timeout

    def pid():
        return next(r for r in engine._ranks if r.rank == rank).pid

    while engine.rank_set.joining or pid() in (old, 0):
        assert time.monotonic() < deadline, f"rank {rank} was not replaced"
        engine.get_metrics()


@pytest.mark.timeout(300)
def test_a_rank_killed_while_an_update_is_in_flight_is_recovered_on_the_new_weights(
    paths, expected  # noqa: F811
):
    """Rank 1 is stopped (SIGSTOP) so it cannot answer, the update is sent, then rank 1 is
    SIGKILLed: the call recovers and returns, and both ranks serve B. A second kill, then an
    update while the replacement is still joining."""
    a, b = paths
    out_a, out_b = expected
    llm = _dp_llm(a, enable_elastic_recovery=True)
    engine = llm.llm_engine
    try:
        assert _tokens(llm) == out_a
        victim = engine._ranks[1].pid
        os.kill(victim, signal.SIGSTOP)
        result = {}

        def call():
            try:
                result["n"] = llm.update_weights(_hf_state_dict(b))
            except BaseException as exc:  # noqa: BLE001
                result["exc"] = exc

        t = threading.Thread(target=call)
        t.start()
        time.sleep(3.0)
        assert t.is_alive()  # waiting for rank 1
        os.kill(victim, signal.SIGKILL)
        t.join(180)
        assert not t.is_alive(), "update_weights hung after the rank was killed"
        assert "exc" not in result, repr(result.get("exc"))
        _wait_replaced(engine, 1, victim)
        assert _tokens(llm) == out_b
        replacement = next(r for r in engine._ranks if r.rank == 1)
        before = replacement.done_tokens
        assert _tokens(llm) == out_b
        assert replacement.done_tokens > before

        # kill again, give the failure time to be noticed, then update while it joins
        victim = replacement.pid
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not engine.rank_set.joining:
            assert time.monotonic() < deadline, "failure not noticed"
            engine.get_metrics()
        assert llm.update_weights(a) > 0
        _wait_replaced(engine, 1, victim)
        assert _tokens(llm) == out_a
        assert engine.get_metrics()["recoveries"] == 2
    finally:
        engine.shutdown()


@pytest.mark.timeout(200)
def test_a_rank_killed_during_an_update_without_recovery_raises_naming_it(paths):  # noqa: F811
    a, b = paths
    llm = _dp_llm(a)
    engine = llm.llm_engine
    try:
        victim = engine._ranks[1].pid
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="rank 1") as info:
            llm.update_weights(_hf_state_dict(b))
        assert time.monotonic() - t0 < 60
        print(type(info.value).__name__, info.value)
        with pytest.raises(Exception, match="rank 1"):
            llm.reset_prefix_cache()
    finally:
        engine.shutdown()
