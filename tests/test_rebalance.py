"""Straggler rebalancing (`straggler_rebalance_interval_steps`): the decision rule, a request
continuing on another engine with the output an unmoved run gives, and skewed jobs on two ranks
(expert-parallel and independent) that move requests and still answer every request once with
one process's tokens.

Every case that starts ranks carries a timeout and stops its rank processes before returning.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from batchgen import LLM, SamplingParams
from batchgen.distributed import protocol as msg
from batchgen.distributed import rebalance
from batchgen.distributed.rebalance import Candidate, Move, plan_moves

# ---- the decision rule (pure Python) -----------------------------------------------------


def _c(request_id: str, rank: int, remaining: int, computed: int = 0) -> Candidate:
    return Candidate(request_id, rank, remaining, computed)


def test_moves_go_from_the_most_to_the_least_loaded_rank_until_the_gap_is_small():
    cands = [_c(f"a{i}", 0, 100) for i in range(6)] + [_c("b0", 1, 50)]
    moves = plan_moves([600, 50], [None, None], cands)
    # 600/50 -> 500/150 -> 400/250 -> 300/350: three moves, then the gap (50) is under 64.
    assert moves == [Move("a0", 0, 1), Move("a1", 0, 1), Move("a2", 0, 1)]


def test_a_move_must_lower_the_peak_and_recompute_counts_against_it():
    # Moving the one request would give rank 1 100 + 10 + 200 = 310 > 250: no gain, no move.
    assert plan_moves([250, 100], [None, None], [_c("x", 0, 10, 200)]) == []
    # A waiting request (nothing to recompute) beats a started one of the same size.
    moves = plan_moves([400, 0], [None, None], [_c("run", 0, 100, 30), _c("wait", 0, 100)])
    assert moves[0] == Move("wait", 0, 1)


def test_started_requests_move_only_where_their_kv_fits():
    cands = [_c("big", 0, 100, 500), _c("small", 0, 100, 20)]
    assert plan_moves([1000, 0], [None, 100], cands) == [Move("small", 0, 1)]
    assert plan_moves([1000, 0], [None, None], cands)[0] == Move("small", 0, 1)  # cheaper first


def test_the_plan_is_deterministic_and_spreads_over_several_ranks():
    cands = [_c(f"r{i}", 2, 100) for i in range(9)]
    first = plan_moves([0, 0, 900], [None] * 3, cands)
    assert first == plan_moves([0, 0, 900], [None] * 3, cands)
    assert sorted(m.dst for m in first) == [0, 0, 0, 1, 1, 1]
    assert [m.request_id for m in first] == [f"r{i}" for i in range(6)]  # earliest first


def test_within_an_expert_parallel_group_only_waiting_requests_move():
    recompute = [_c("run", 0, 200, 50)]
    shipped = [Candidate("run", 0, 200, 50, ship=True, price=5.0)]
    # Ranks 0 and 1 step together: a started request stays, shipped or not.
    assert plan_moves([400, 0], [None, None], recompute, groups=[0, 0]) == []
    assert plan_moves([400, 0], [None, None], shipped, groups=[0, 0]) == []
    # Independent ranks (or another group): it moves when that lowers the peak.
    assert plan_moves([400, 0], [None, None], shipped, groups=[0, 1]) == [Move("run", 0, 1)]
    assert plan_moves([400, 0], [None, None], recompute, groups=[0, 1]) == [Move("run", 0, 1)]
    # Two groups of two: rank 0's request goes to the other group's idle rank 2, not rank 1.
    moves = plan_moves([400, 300, 0, 300], [None] * 4, recompute, groups=[0, 0, 1, 1])
    assert moves == [Move("run", 0, 2)]
    # Waiting requests move within a group as metadata.
    assert plan_moves([400, 0], [None, None], [_c("w", 0, 200)], groups=[0, 0]) == [Move("w", 0, 1)]


def test_ship_or_recompute_compares_the_kv_compute_rate_with_the_measured_link():
    price = rebalance.KVPrice()
    load = msg.Load(0, 1, [], 0, kv_bytes_per_token=16384, tokens_per_s=2000.0)
    price.note_load(0, load)  # 32.8 MB/s of K/V computed, against the 100 MB/s default
    assert price.ship and price.price(100) == pytest.approx(100 * 16384 * 2000 / 100e6)
    price.note_transfer(1_000_000, 0.1)  # the first measurement replaces the default
    assert price.link_bytes_per_s == pytest.approx(1e7)
    assert not price.ship and price.price(100) == 100.0
    price.note_transfer(10**9, 1.0)  # then the best rate seen
    price.note_transfer(10**6, 1.0)
    assert price.link_bytes_per_s == pytest.approx(1e9) and price.ship


def test_balanced_or_unmovable_loads_give_no_moves():
    assert plan_moves([100, 90], [None, None], [_c("a", 0, 50)]) == []
    assert plan_moves([1000, 0], [None, None], []) == []  # e.g. everything pinned or moving


# ---- the frontend's side of a move, against a fake rank set (no processes) ------------------


class _FakeRankSet:
    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []
        self.failure, self.closed, self.joining = None, False, False

    def send(self, rank, message) -> None:
        self.sent.append((rank.rank, message))

    def taken(self, kind) -> list[tuple[int, object]]:
        out = [(r, m) for r, m in self.sent if isinstance(m, kind)]
        self.sent = [(r, m) for r, m in self.sent if not isinstance(m, kind)]
        return out


def _frontend(**parallel):
    """A `DPEngineClient` with two fake ranks (its __init__ would start processes)."""
    import itertools

    from batchgen.config import ParallelConfig
    from batchgen.distributed.frontend import DPEngineClient
    from batchgen.distributed.rank_handle import RankHandle
    from batchgen.distributed.rebalance import Rebalancer
    from batchgen.distributed.recovery import ElasticRecovery

    client = object.__new__(DPEngineClient)
    client.parallel = ParallelConfig(
        data_parallel_size=2, straggler_rebalance_interval_steps=1, **parallel
    )
    client.rank_set = _FakeRankSet()
    client._ranks = [RankHandle(r, None, "host", 100 + r) for r in range(2)]
    client.requests, client._finished, client._fatal = {}, [], None
    client.rebalancer = Rebalancer(client)
    client.recovery = ElasticRecovery(client.parallel)
    client._round_robin = itertools.count()
    client.max_model_len = 1000
    return client


def _add(client, rid: str, max_tokens: int, rank: int | None = None) -> None:
    from batchgen.engine.input_processor import ProcessedPrompt

    prompt = ProcessedPrompt(None, [1, 2, 3, 4])
    client.add_processed_request(rid, prompt, _greedy(max_tokens), data_parallel_rank=rank)


def _state(started: bool):
    from batchgen.engine.migration import RequestState, SequenceState
    from batchgen.outputs import RequestMetrics

    seq = SequenceState(0, [7, 8] if started else [], 0.0, None, None, {}, False, None, None, 0)
    return RequestState(RequestMetrics(1.0), [seq], num_computed_tokens=6 if started else 0)


def test_the_frontend_releases_lands_and_drops_what_was_aborted_meanwhile():
    client = _frontend(load_balance_method="round_robin")
    _add(client, "w0", 200)  # round robin: rank 0
    _add(client, "s0", 2, rank=1)  # pinned requests do not advance the turn
    _add(client, "w1", 200)  # rank 1
    _add(client, "w2", 200)  # rank 0
    _add(client, "pinned", 300, rank=0)
    assert [client.requests[r].rank for r in ("w0", "w1", "w2")] == [0, 1, 0]
    client.abort_request("w1")  # still queued on the frontend: nothing to tell the rank
    assert not client.rank_set.sent
    report = [("w0", 150, 20, True), ("w2", 204, 0, False), ("pinned", 290, 10, True)]
    client._dispatch([(client._ranks[0], msg.Load(0, 1, report, 10_000))])
    assert client.rank_set.taken(msg.AddRequests)  # queued requests reach their ranks first
    ((src, release),) = client.rank_set.taken(msg.Release)
    # 644 vs 6: w2 (no recompute) first, then w0 (peak 380 < 440); the pinned one never
    assert src == 0 and release.request_ids == ["w2", "w0"]
    # No K/V rate reported yet: shipping counts as cheaper, for every request released (a
    # waiting one may have started by the time the rank releases it).
    assert release.ship_kv == ["w2", "w0"]
    assert client.requests["w0"].moving and client.requests["w2"].moving
    client._dispatch([(client._ranks[0], msg.Load(0, 2, report, 10_000))])
    assert not client.rank_set.sent  # one round in flight at a time
    client.abort_request("w2")  # the caller aborts a request while it moves
    assert client.rank_set.taken(msg.Abort) == [(0, msg.Abort(["w2"]))]
    states = {"w0": _state(started=True), "w2": _state(started=False)}
    client._dispatch([(client._ranks[0], msg.Released(0, release.token, states, 123))])
    ((dst, add),) = client.rank_set.taken(msg.AddRequests)
    assert dst == 1 and [(r[0], r[4]) for r in add.requests] == [("w0", states["w0"])]
    assert client.requests["w0"].rank == 1 and not client.requests["w0"].moving
    assert "w2" not in client.requests and not client.rebalancer.releases
    assert client.rebalancer.metrics.as_dict() == {
        "rebalance_rounds": 1,
        "requests_moved": 1,
        "sequences_moved": 1,
        "requests_moved_by_recompute": 1,  # the fake state carries no K/V
        "requests_moved_with_kv": 0,
        "rebalance_tokens_recomputed": 6,
        "rebalance_kv_tokens_shipped": 0,
        "rebalance_kv_bytes_shipped": 0,
        "rebalance_bytes_shipped": 123,
        "rebalance_link_bytes_per_s": rebalance.DEFAULT_LINK_BYTES_PER_S,
    }
    assert client._ranks[0].load == client.requests["pinned"].load
    # a stale answer (e.g. from ranks replaced by a recovery) changes nothing
    client._dispatch([(client._ranks[0], msg.Released(0, release.token, states, 5))])
    assert client.rebalancer.metrics.requests_moved == 1 and not client.rank_set.sent


# ---- a request continuing on another engine ---------------------------------------------


def _requests() -> list[tuple[str, str, SamplingParams]]:
    stops = list(range(3, 512, 9))  # ends seeded samples at different, reproducible points
    return [
        ("greedy", "the first request", SamplingParams(max_tokens=18, temperature=0.0, logprobs=2)),
        (
            "seeded-n3",
            "a seeded request with three samples",
            SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=7, stop_token_ids=stops),
        ),
        (
            "seeded",
            "top p and a seed",
            SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, logprobs=1),
        ),
        ("waiting", "never started before it moves", SamplingParams(max_tokens=12, seed=5)),
    ]


def _finish(engines, done: dict) -> None:
    deadline = time.monotonic() + 120
    while any(e.has_unfinished_requests() for e in engines):
        assert time.monotonic() < deadline, "a hang"
        for e in engines:
            if e.has_unfinished_requests():
                for out in e.step():
                    assert out.request_id not in done, "answered twice"
                    done[out.request_id] = out


def _same_output(a, b) -> None:
    assert a.error is None and b.error is None
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert (x.index, x.token_ids, x.text) == (y.index, y.token_ids, y.text)
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        assert (x.cumulative_logprob is None) == (y.cumulative_logprob is None)
        if x.cumulative_logprob is not None:
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)
        assert (x.logprobs is None) == (y.logprobs is None)
        for p, q in zip(x.logprobs or [], y.logprobs or [], strict=True):
            assert p.keys() == q.keys()
            for t in p:
                assert p[t].logprob == pytest.approx(q[t].logprob, abs=1e-4)
                assert (p[t].rank, p[t].decoded_token) == (q[t].rank, q[t].decoded_token)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "model, ship_kv",
    [("mixtral", False), ("mixtral", True), ("deepseek_v3", True)],
    ids=["recompute", "ship-kv", "ship-kv-mla"],
)
def test_a_released_request_continues_elsewhere_with_the_unmoved_output(
    checkpoint_dir, model, ship_kv
):
    """Requests leave engine A mid-decode (running, some samples of an n=3 request already
    finished) or before they started, continue on engine B by recompute or with their K/V
    shipped (GQA caches, and MLA's latent and rope-key caches), and end with the output an
    unmoved run gives: tokens, text, logprobs, finish reasons. Shipped K/V are the source's
    own bits, so on the GQA path (the CPU decode kernel reads each row's cache in place,
    independent of its batch-mates) the logprobs are equal, not only close; MLA's decode pads
    each bucket to its longest context, so there other batch-mates can move the last bits."""
    path = str(checkpoint_dir(model))
    a = LLM(path, max_num_seqs=3).llm_engine
    b = LLM(path, max_num_seqs=3).llm_engine
    reference: dict = {}
    for rid, prompt, params in _requests():
        a.add_request(rid, prompt, params)
    _finish([a], reference)
    assert a.kv_cache.num_free_blocks == a.kv_cache.num_blocks

    for rid, prompt, params in _requests():
        a.add_request(rid, prompt, params)
    done: dict = {}
    for _ in range(6):
        for out in a.step():
            done[out.request_id] = out
    states = {}
    for rid, prompt, params in _requests():
        state = a.release_request(rid, ship_kv=ship_kv)
        if state is None:
            continue  # finished before the move
        states[rid] = state
        assert state.num_shipped_tokens == (state.num_computed_tokens if ship_kv else 0)
        processed = b.input_processor.process(prompt, params)
        b.add_processed_request(rid, processed, params, resume=state)
    assert a.release_request("greedy") is None and not a.has_unfinished_requests()
    assert a.kv_cache.num_free_blocks == a.kv_cache.num_blocks  # the K/V was dropped
    assert states["greedy"].started and not states["waiting"].started  # 3 seats, taken
    n3 = states["seeded-n3"].seqs
    assert len(n3) == 3 and all(s.generator_state for s in n3)
    _finish([a, b], done)
    assert sorted(done) == sorted(reference)
    for rid in reference:
        _same_output(done[rid], reference[rid])
    shipped = sum(s.num_shipped_tokens for s in states.values())
    assert b.get_metrics()["kv_imported_tokens"] == shipped
    if ship_kv:
        assert shipped > 0 and b.kv_cache.num_free_blocks == b.kv_cache.num_blocks
    if ship_kv and model == "mixtral":
        for rid in ("greedy", "seeded"):  # moved mid-decode: bit-identical logprobs
            got, want = done[rid].outputs[0], reference[rid].outputs[0]
            assert got.cumulative_logprob == want.cumulative_logprob


def test_a_resume_state_must_fit_the_request(checkpoint_dir):
    from batchgen.engine.migration import RequestState
    from batchgen.outputs import RequestMetrics

    engine = LLM(str(checkpoint_dir("mixtral"))).llm_engine
    processed = engine.input_processor.process("hi", SamplingParams(n=2))
    with pytest.raises(ValueError, match="resume state of 0 samples for n=2"):
        engine.add_processed_request(
            "x", processed, SamplingParams(n=2), resume=RequestState(RequestMetrics(0.0))
        )
    assert not engine.has_unfinished_requests()


# ---- skewed jobs on two ranks ---------------------------------------------------------------


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _seeded(max_tokens: int, seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True, logprobs=1
    )


def _skewed(tag: str, long: int = 40) -> list[tuple[str, str, SamplingParams]]:
    """Long and short requests alternating: round robin puts every long one on rank 0."""
    out = []
    for i in range(4):
        params = _greedy(long) if i % 2 == 0 else _seeded(long, seed=10 + i, n=1 + i % 3)
        out.append((f"{tag}-long-{i}", f"a long {tag} request number {i} " * 2, params))
        out.append((f"{tag}-short-{i}", f"short {i}", _greedy(2)))
    return out


def _run_skewed(llm: LLM, requests, pinned: dict | None = None):
    """Run ``requests`` on ``llm``'s frontend; returns (outputs by id, ids answered, moves)."""
    engine = llm.llm_engine
    moves: list[tuple[str, int]] = []
    assign = engine._assign

    def spy(request_id, request, dst=None, resume=None):
        if dst is not None:
            moves.append((request_id, dst))
        assign(request_id, request, dst, resume)

    engine._assign = spy
    engine.reset_metrics()  # the metrics of this job only
    try:
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params, data_parallel_rank=(pinned or {}).get(rid))
        got, answered = {}, []
        deadline = time.monotonic() + 180
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the job did not finish: a hang"
            for out in engine.step():
                answered.append(out.request_id)
                got[out.request_id] = out
    finally:
        del engine._assign
    return got, answered, moves


@pytest.fixture(scope="module")
def ep_rebalanced(checkpoint_dir):
    llm = LLM(
        str(checkpoint_dir("mixtral")),
        data_parallel_size=2,
        enable_expert_parallel=True,
        load_balance_method="round_robin",
        straggler_rebalance_interval_steps=2,
        max_num_seqs=2,  # rank 0's long requests wait for a seat: those are what may move
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def mixtral_single(checkpoint_dir):
    return LLM(str(checkpoint_dir("mixtral")))


def _reference(single: LLM, requests) -> dict:
    outs = single.generate([p for _, p, _ in requests], [s for _, _, s in requests], use_tqdm=False)
    return {rid: out for (rid, _, _), out in zip(requests, outs, strict=True)}


@pytest.mark.timeout(300)
def test_a_skewed_job_on_expert_parallel_ranks_moves_requests_and_keeps_outputs(
    ep_rebalanced, mixtral_single
):
    requests = _skewed("ep")
    requests.append(("pinned", "a long pinned request", _greedy(40)))
    got, answered, moves = _run_skewed(ep_rebalanced, requests, pinned={"pinned": 0})
    assert sorted(answered) == sorted(rid for rid, _, _ in requests)  # each exactly once
    want = _reference(mixtral_single, requests)
    for rid in want:
        _same_output(got[rid], want[rid])
    assert moves and "pinned" not in {rid for rid, _ in moves}
    assert any(dst == 1 and "long" in rid for rid, dst in moves)  # off the straggler
    m = ep_rebalanced.get_metrics()
    assert m["requests_moved"] == len(moves) > 0
    # Inside an expert-parallel group only requests waiting for a seat move (one may have
    # started by the time its rank releases it: its K/V are shipped then), so no K/V is ever
    # recomputed; each destination imported exactly what was shipped.
    assert m["rebalance_tokens_recomputed"] == 0
    assert sum(r["kv_imported_tokens"] for r in m["ranks"]) == m["rebalance_kv_tokens_shipped"]
    assert m["rebalance_bytes_shipped"] > 0
    assert m["sequences_moved"] >= m["requests_moved"]
    assert m["rebalance_rounds"] > 0
    assert len(m["rank_busy_seconds"]) == 2 and all(s > 0 for s in m["rank_busy_seconds"])
    assert not ep_rebalanced.llm_engine.rebalancer.releases  # no move left in flight


@pytest.mark.timeout(300)
def test_aborting_a_request_while_it_moves(ep_rebalanced, mixtral_single):
    """The caller aborts a request right after the frontend asked its rank to release it: it
    is never answered nor run elsewhere, and every other request is answered once."""
    engine = ep_rebalanced.llm_engine
    aborted: list[str] = []
    send = engine.rank_set.send

    def send_then_abort(rank, message):
        send(rank, message)
        if isinstance(message, msg.Release) and not aborted:
            aborted.append(message.request_ids[0])
            engine.abort_request(message.request_ids[0])

    engine.rank_set.send = send_then_abort
    try:
        requests = _skewed("abort")
        got, answered, moves = _run_skewed(ep_rebalanced, requests)
    finally:
        del engine.rank_set.send
    assert len(aborted) == 1 and aborted[0] not in answered
    assert aborted[0] not in [rid for rid, _ in moves]
    assert sorted(answered) == sorted(rid for rid, _, _ in requests if rid != aborted[0])
    want = _reference(mixtral_single, requests)
    for rid in answered:
        _same_output(got[rid], want[rid])
    assert not engine.requests


@pytest.mark.timeout(400)
def test_a_skewed_job_on_independent_dense_ranks(checkpoint_dir):
    """llama, two ranks that never wait for each other; one sequence per rank at a time, so
    the long requests wait on rank 0 and move before they start. The same job without
    rebalancing, and one process, give the same outputs."""
    path = str(checkpoint_dir("llama"))
    requests = _skewed("dense", long=24)
    want = _reference(LLM(path), requests)
    metrics = {}
    for interval in (None, 1):
        llm = LLM(
            path,
            data_parallel_size=2,
            load_balance_method="round_robin",
            straggler_rebalance_interval_steps=interval,
            max_num_seqs=1,
        )
        try:
            got, answered, moves = _run_skewed(llm, requests)
            assert sorted(answered) == sorted(want)
            for rid in want:
                _same_output(got[rid], want[rid])
            metrics[interval] = llm.get_metrics()
        finally:
            llm.shutdown()
        assert metrics[interval]["requests_moved"] == len(moves)
    assert metrics[None]["requests_moved"] == 0
    m = metrics[1]
    assert m["requests_moved"] > m["requests_moved_by_recompute"]  # some moved before starting
    assert m["requests_moved"] > 0


@pytest.mark.timeout(400)
def test_rebalancing_does_not_break_elastic_recovery(checkpoint_dir, mixtral_single):
    """Rank 1 is killed once requests have moved: the ranks restart, the unfinished requests
    start over, and every request is answered once with one process's tokens."""
    llm = LLM(
        str(checkpoint_dir("mixtral")),
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_elastic_recovery=True,
        load_balance_method="round_robin",
        straggler_rebalance_interval_steps=2,
        max_num_seqs=2,  # requests wait for a seat on rank 0: those move within the group
    )
    engine = llm.llm_engine
    requests = _skewed("recover", long=48)
    killed = None
    try:
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        got, answered = {}, []
        deadline = time.monotonic() + 300
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the job did not finish: a hang"
            for out in engine.step():
                answered.append(out.request_id)
                got[out.request_id] = out
            if killed is None and engine.rebalancer.metrics.requests_moved:
                killed = engine._ranks[1].pid
                os.kill(killed, signal.SIGKILL)
        assert killed is not None
        assert sorted(answered) == sorted(rid for rid, _, _ in requests)
        want = _reference(mixtral_single, requests)
        for rid in want:
            _same_output(got[rid], want[rid])
        assert llm.get_metrics()["recoveries"] == 1
        assert killed not in [r.pid for r in engine._ranks]
    finally:
        llm.shutdown()


def test_load_balance_method_is_validated():
    from batchgen.config import ParallelConfig

    with pytest.raises(ValueError, match="load_balance_method must be one of"):
        ParallelConfig(load_balance_method="random")
    assert ParallelConfig(data_parallel_size=2, load_balance_method="round_robin")


def test_gap_threshold_is_a_module_setting(monkeypatch):
    monkeypatch.setattr(rebalance, "MIN_GAP_TOKENS", 1000)
    assert plan_moves([600, 0], [None, None], [_c("a", 0, 100)]) == []


@pytest.mark.timeout(300)
def _released_midway(engine, rid, prompt, params):
    """Run the request to the end on ``engine`` (the unmoved reference output), then again for
    4 steps and release it with its K/V: ``(reference outputs by id, the released state)``."""
    reference: dict = {}
    engine.add_request(rid, prompt, params)
    _finish([engine], reference)
    engine.add_request(rid, prompt, params)
    for _ in range(4):
        assert not engine.step()
    return reference, engine.release_request(rid, ship_kv=True)


def test_shipped_kv_moves_on_when_its_request_moves_again_before_admission(checkpoint_dir):
    """A request moved with its K/V is moved again while it still waits on the second engine
    (its K/V not yet written there): the K/V goes on to the third engine unchanged, nothing is
    recomputed, and the output is the unmoved one."""
    path = str(checkpoint_dir("mixtral"))
    a, b, c = (LLM(path).llm_engine for _ in range(3))
    rid, prompt, params = _requests()[0]  # greedy, with logprobs
    reference, first = _released_midway(a, rid, prompt, params)
    assert first.num_shipped_tokens == first.num_computed_tokens > 0
    b.add_processed_request(rid, b.input_processor.process(prompt, params), params, resume=first)
    assert b.load_report()[0][2] == first.num_computed_tokens  # held, though not admitted
    second = b.release_request(rid)  # not asked to ship: what it holds travels anyway
    assert second.seqs[0].kv is first.seqs[0].kv
    assert second.num_computed_tokens == second.num_shipped_tokens
    c.add_processed_request(rid, c.input_processor.process(prompt, params), params, resume=second)
    done: dict = {}
    _finish([c], done)
    _same_output(done[rid], reference[rid])
    assert done[rid].outputs[0].cumulative_logprob == reference[rid].outputs[0].cumulative_logprob
    assert c.get_metrics()["kv_imported_tokens"] == first.num_computed_tokens


def test_shipped_fp8_kv_lands_byte_for_byte(checkpoint_dir):
    """kv_cache_dtype fp8: a request released with its K/V mid-decode continues on another
    engine from the shipped fp8 bytes (fp8 has no index_copy_: written as bytes) with the
    unmoved output; an engine of another KV dtype refuses the payload, naming both dtypes."""
    path = str(checkpoint_dir("mixtral"))
    a, b = (LLM(path, kv_cache_dtype="fp8").llm_engine for _ in range(2))
    rid, prompt, params = _requests()[0]
    reference, moved = _released_midway(a, rid, prompt, params)
    assert moved.seqs[0].kv.dtype == "float8_e4m3fn" and moved.num_shipped_tokens > 0
    b.add_processed_request(rid, b.input_processor.process(prompt, params), params, resume=moved)
    done: dict = {}
    _finish([b], done)
    _same_output(done[rid], reference[rid])
    assert b.get_metrics()["kv_imported_tokens"] == moved.num_shipped_tokens
    from batchgen.engine.migration import import_kv

    other = LLM(path).llm_engine  # float32 cache
    with pytest.raises(ValueError, match="of float8_e4m3fn does not fit .* of float32"):
        import_kv(other.runner.kv_caches, other.runner.block_size, [0, 1, 2], moved.seqs[0].kv)
