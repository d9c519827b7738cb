"""The snapshot store (``--snapshot-storage-uri``): round trips on a local directory and on a
local S3-compatible server (moto's, started here: real HTTP, s3fs, no mock objects), a
manifest of another job refused naming what differs, temporaries and truncated segments
ignored, the output and the snapshot brought level on restart; and a whole ``batchgen run``
killed with SIGKILL and restarted from the snapshot on a new, empty output path completing
every custom_id exactly once, with the results stored before the kill unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from test_batch_runner import (
    MIXED,
    FakeEngine,
    Stop,
    completion_line,
    read_results,
    write_lines,
)

from batchgen.config import ParallelConfig
from batchgen.entrypoints import cli, cli_flags
from batchgen.entrypoints.batch_runner import run_batch_file
from batchgen.entrypoints.snapshot_store import (
    Manifest,
    SnapshotError,
    SnapshotStore,
    SnapshotTakenOverError,
    SnapshotWriter,
)

BATCHGEN = [sys.executable, "-m", "batchgen.entrypoints.cli"]
BUCKET = "batchgen-snapshots"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on a free loopback port with one bucket; yields its endpoint URL."""
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


def s3_options(endpoint: str) -> dict:
    """fsspec storage options for the moto server (what users set with AWS_ENDPOINT_URL)."""
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }


@pytest.fixture(params=["file", "s3"])
def store_at(request, tmp_path):
    """``make(name) -> SnapshotStore`` at a fresh location of the backend."""

    def make(name: str) -> SnapshotStore:
        if request.param == "file":
            return SnapshotStore(f"file://{tmp_path / name}")
        endpoint = request.getfixturevalue("s3_endpoint")
        return SnapshotStore(f"s3://{BUCKET}/{request.node.name}/{name}/", s3_options(endpoint))

    return make


def manifest(**changes) -> Manifest:
    fields = dict(
        input_sha256="ab" * 32,
        input_size=123,
        model="tiny",
        settings={"dtype": "auto", "seed": 0, "tokenizer": None, "max_model_len": None},
        input_name="in.jsonl",
    )
    return Manifest(**{**fields, **changes})


def result_line(custom_id: str, text: str = "x") -> bytes:
    body = {"choices": [{"text": text}]}
    result = {"id": f"batch_req_{custom_id}", "custom_id": custom_id, "error": None}
    result["response"] = {"status_code": 200, "request_id": "r", "body": body}
    return (json.dumps(result, separators=(",", ":")) + "\n").encode()


# ---- the store


@pytest.mark.timeout(120)
def test_segments_round_trip_in_order_with_progress(store_at):
    store = store_at("job")
    store.open_job(manifest())
    assert store.segments() == [] and store.read_manifest() == manifest()
    writer = SnapshotWriter(store, max_results=2, max_age_s=3600, total=5)
    lines = [result_line(f"r{i}") for i in range(5)]
    for line in lines:
        writer.add(line)
        writer.maybe_flush()
    assert writer.pending == 1 and len(store.segments()) == 2
    writer.flush(finished=True)

    again = store_at("job")  # another process: a new store object on the same URI
    again.open_job(manifest())
    names = again.segments()
    assert len(names) == 3 and names == sorted(names)
    assert [n.split("-")[1] for n in names] == ["00000001", "00000002", "00000003"]
    assert list(again.iter_result_lines()) == lines
    assert again.read_manifest() == manifest()
    progress = again.read_progress()
    assert progress["results"] == 5 and progress["total_requests"] == 5
    assert progress["finished"] is True and progress["last_segment"] == names[-1]
    # A restarted writer continues the numbering under its own run id.
    later = SnapshotWriter(again, max_results=10, max_age_s=3600)
    later.add(result_line("r5"))
    later.flush()
    assert again.segments()[-1].startswith("seg-00000004-" + later.run_id)


@pytest.mark.timeout(120)
def test_a_segment_is_written_when_its_oldest_result_is_old_enough(store_at):
    store = store_at("job")
    store.open_job(manifest())
    writer = SnapshotWriter(store, max_results=1000, max_age_s=0.2)
    writer.add(result_line("a"))
    writer.maybe_flush()
    assert store.segments() == []
    time.sleep(0.25)
    writer.maybe_flush()
    assert len(store.segments()) == 1 and writer.pending == 0


@pytest.mark.timeout(120)
def test_another_jobs_snapshot_is_refused_naming_what_differs(store_at):
    store = store_at("job")
    store.open_job(manifest())
    writer = SnapshotWriter(store)
    writer.add(result_line("a"))
    writer.flush()
    other = manifest(model="other", settings={**manifest().settings, "dtype": "bfloat16"})
    with pytest.raises(SnapshotError) as err:
        store_at("job").open_job(other)
    text = str(err.value)
    assert "another job" in text and "model: snapshot 'tiny', this run 'other'" in text
    assert "dtype: snapshot 'auto', this run 'bfloat16'" in text and "seed" not in text
    with pytest.raises(SnapshotError, match="input file: snapshot 'in.jsonl' \\(123 bytes"):
        store_at("job").open_job(manifest(input_sha256="cd" * 32))
    store_at("job").open_job(manifest(input_name="renamed.jsonl"))  # the name is not compared


@pytest.mark.timeout(120)
def test_a_manifest_without_results_is_replaced(store_at, caplog):
    store_at("job").open_job(manifest(model="a model that failed to load"))
    store_at("job").open_job(manifest())
    assert store_at("job").read_manifest() == manifest()
    assert "replacing the manifest of another job that stored no results (input " in caplog.text
    assert "it differs in model: snapshot 'a model that failed to load'" in caplog.text


@pytest.mark.timeout(120)
def test_a_job_whose_manifest_was_replaced_stops_and_is_never_restored(store_at, caplog):
    """Job A opened the URI but stored nothing yet; job B (another input) replaced its
    manifest. A's next segment write is refused naming the URI and B; a segment A wrote in
    the race window (between B's check and B's manifest) is never read as B's."""
    a_store = store_at("job")
    a_store.open_job(manifest(input_name="big.jsonl"))
    a = SnapshotWriter(a_store)
    b_store = store_at("job")
    b_store.open_job(manifest(input_sha256="cd" * 32, input_name="small.jsonl"))
    assert a_store.manifest.job_id != b_store.manifest.job_id
    assert b_store.read_manifest().job_id == b_store.manifest.job_id
    a.add(result_line("req-0", "A's text"))
    with pytest.raises(SnapshotTakenOverError) as err:
        a.flush()
    text = str(err.value)
    assert a_store.where("manifest.json") in text and "input 'small.jsonl'" in text
    assert f"job id {b_store.manifest.job_id}" in text and "--resume" in text
    with pytest.raises(SnapshotTakenOverError):  # and it stays refused
        a.flush(finished=True)
    assert a_store.segments() == [] and a.pending == 1
    # The race: A's segment lands after B replaced the manifest (A checked just before).
    a_store.write_segment(1, "aaaa", [result_line("req-0", "A's text")])
    b = SnapshotWriter(b_store)
    b.add(result_line("req-1", "B's text"))
    b.flush()
    assert len(b_store.segments()) == 2
    restarted = store_at("job")
    restarted.open_job(manifest(input_sha256="cd" * 32, input_name="small.jsonl"))
    assert restarted.manifest.job_id == b_store.manifest.job_id  # the same job keeps its id
    assert list(restarted.iter_result_lines()) == [result_line("req-1", "B's text")]
    assert "ignoring 1 segments of another job" in caplog.text
    # A restarted on the URI now holding B's results is refused (the segments count).
    with pytest.raises(SnapshotError, match="holds the snapshot of another job"):
        store_at("job").open_job(manifest(input_name="big.jsonl"))


@pytest.mark.timeout(60)
def test_segments_from_before_job_ids_are_still_read(tmp_path):
    """A manifest and segments written before job ids (no job_id, untagged segment names)."""
    uri = f"file://{tmp_path / 'old'}"
    store = SnapshotStore(uri)
    store.fs.makedirs(store.path("results"), exist_ok=True)
    body = json.loads(manifest().to_json())
    del body["job_id"], body["created_at"]
    store.fs.pipe_file(store.path("manifest.json"), json.dumps(body).encode())
    store.fs.pipe_file(store.path("results", "seg-00000001-aa.jsonl"), result_line("a"))
    again = SnapshotStore(uri)
    again.open_job(manifest())
    assert again.manifest.job_id is None
    writer = SnapshotWriter(again)
    writer.add(result_line("b"))
    writer.flush()
    assert again.segments()[-1] == f"seg-00000002-{writer.run_id}.jsonl"
    assert list(SnapshotStore(uri).iter_result_lines()) == [result_line("a"), result_line("b")]


@pytest.mark.timeout(120)
def test_temporaries_and_a_truncated_last_line_are_ignored(store_at, caplog):
    store = store_at("job")
    store.open_job(manifest())
    writer = SnapshotWriter(store)
    writer.add(result_line("a"))
    writer.flush()
    results = store.path("results")
    # A killed writer's temporary, and a segment some backend exposed half written.
    store.fs.pipe_file(f"{results}/.seg-00000002-dead.jsonl.tmp-0123", result_line("tmp"))
    torn = result_line("b") + result_line("c")[:20]
    store.fs.pipe_file(f"{results}/seg-00000002-beef.jsonl", torn)
    assert list(store_at("job").iter_result_lines()) == [result_line("a"), result_line("b")]
    assert "incomplete last line" in caplog.text


@pytest.mark.timeout(120)
def test_results_without_a_manifest_are_refused(store_at):
    store = store_at("job")
    store.fs.makedirs(store.path("results"), exist_ok=True)
    store.fs.pipe_file(store.path("results", "seg-00000001-aa.jsonl"), result_line("a"))
    with pytest.raises(SnapshotError, match="holds result segments but no manifest.json"):
        store_at("job").open_job(manifest())


@pytest.mark.timeout(60)
def test_writes_are_atomic_by_rename_locally_and_by_one_put_on_object_stores(tmp_path):
    local = SnapshotStore(str(tmp_path / "plain-path"))  # a plain path is a local directory
    assert (local.atomic_put, local.local) == (False, True)
    local.open_job(manifest())
    SnapshotWriter(local).flush(finished=True)
    assert sorted(p.name for p in (tmp_path / "plain-path").iterdir()) == [
        "manifest.json",
        "progress.json",
    ]  # no temporary left behind
    assert SnapshotStore("memory://snap", allow_memory=True).atomic_put
    assert SnapshotStore("~/snap").root == str(Path.home() / "snap")  # from YAML: no shell


@pytest.mark.timeout(60)
def test_a_write_stopped_midway_leaves_no_temporary(tmp_path, monkeypatch):
    """SIGTERM (`cli.Terminated`, a KeyboardInterrupt) or a failed rename between a segment's
    temporary and its rename: the exception goes on, the temporary is removed (was left in
    results/ by every `batchgen run` stopped at that point)."""
    store = SnapshotStore(str(tmp_path / "snap"))
    store.open_job(manifest())
    writer = SnapshotWriter(store)
    writer.add(result_line("a"))
    for exc in (cli.Terminated(), OSError("disk full")):

        def mv(src, dst, exc=exc):
            raise exc

        monkeypatch.setattr(store.fs, "mv", mv)
        with pytest.raises(type(exc)):
            store.write_segment(1, writer.run_id, [result_line("a")])
        assert os.listdir(tmp_path / "snap" / "results") == []


@pytest.mark.timeout(60)
def test_an_unknown_protocol_is_a_clear_error():
    with pytest.raises(SnapshotError, match="snapshot_storage_uri 'nosuch://x'"):
        SnapshotStore("nosuch://x")


@pytest.mark.timeout(60)
def test_a_memory_uri_is_refused_before_the_engine_starts(tmp_path, monkeypatch, capsys):
    with pytest.raises(SnapshotError, match="memory:// keeps the snapshot in this process"):
        SnapshotStore("memory://job")
    started = []
    monkeypatch.setattr(cli_flags, "start_engine", lambda kwargs: started.append(kwargs))
    out = tmp_path / "out.jsonl"
    argv = ["run", "-i", str(_job(tmp_path, 2)), "-o", str(out), "--no-progress"]
    assert cli.main([*argv, "--model", "tiny", "--snapshot-storage-uri", "memory://job"]) == 2
    err = capsys.readouterr().err
    assert "snapshot_storage_uri 'memory://job': memory:// keeps the snapshot" in err
    assert "use a directory (a path or file://) or an object store" in err
    assert started == [] and not out.exists()


@pytest.mark.timeout(120)
def test_a_missing_bucket_fails_when_the_job_opens(s3_endpoint):
    store = SnapshotStore("s3://no-such-bucket/job/", s3_options(s3_endpoint))
    with pytest.raises(OSError):
        store.open_job(manifest())


@pytest.mark.parametrize("uri", ["s3://bucket/prefix/", "file:///dir/", "snaps/job", "/abs/dir"])
def test_a_uri_or_a_path_is_accepted(uri):
    assert ParallelConfig(snapshot_storage_uri=uri).ineffective_settings() == []


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"snapshot_storage_uri": "s3:/bucket"}, "must be a URI"),
        ({"snapshot_storage_uri": ""}, "must be a URI"),
        ({"snapshot_interval_results": 0}, "snapshot_interval_results must be an integer >= 1"),
        ({"snapshot_interval_s": 0}, "snapshot_interval_s must be a number > 0"),
    ],
)
def test_bad_snapshot_settings_name_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ParallelConfig(**kwargs)


def test_intervals_without_a_uri_are_named_in_a_warning():
    assert ParallelConfig(snapshot_interval_s=5).ineffective_settings() == [
        "snapshot_interval_s has no effect without snapshot_storage_uri"
    ]


# ---- run_batch_file with a snapshot (fake engine, milliseconds)


def _job(tmp_path: Path, n: int = 12) -> Path:
    return write_lines(tmp_path / "in.jsonl", [completion_line(f"c{i:02d}") for i in range(n)])


def _writer(uri: str, src: Path, **kwargs) -> SnapshotWriter:
    store = SnapshotStore(uri)
    store.open_job(manifest(input_name=src.name))
    return SnapshotWriter(store, **kwargs)


@pytest.mark.timeout(60)
def test_a_crashed_run_restarts_from_the_snapshot_on_a_new_output(tmp_path):
    src, uri = _job(tmp_path), f"file://{tmp_path / 'snap'}"
    first = tmp_path / "first.jsonl"
    with pytest.raises(Stop):
        run_batch_file(
            FakeEngine(per_step=2, crash_after=4),
            src,
            first,
            progress=False,
            snapshot=_writer(uri, src, max_results=3, max_age_s=3600),
        )
    stored = list(SnapshotStore(uri).iter_result_lines())
    assert len(stored) == 8  # every result finished before the crash (flushed on the way out)
    second = tmp_path / "second.jsonl"
    summary = run_batch_file(
        FakeEngine(per_step=2),
        src,
        second,
        progress=False,
        snapshot=_writer(uri, src, max_results=3, max_age_s=3600),
    )
    assert (summary.restored, summary.skipped, summary.succeeded) == (8, 8, 4)
    lines = second.read_bytes().splitlines(keepends=True)
    assert lines[:8] == stored  # byte for byte
    assert sorted(r["custom_id"] for r in read_results(second)) == [f"c{i:02d}" for i in range(12)]
    ids = [json.loads(line)["custom_id"] for line in SnapshotStore(uri).iter_result_lines()]
    assert Counter(ids) == Counter(f"c{i:02d}" for i in range(12))  # the snapshot: once each
    assert SnapshotStore(uri).read_progress()["finished"] is True


def test_the_input_keys_are_those_of_the_results_the_run_writes(tmp_path):
    """`input_result_keys` (a fast custom_id scan) names exactly the result keys a run of
    the input writes, over every kind of bad line."""
    from batchgen.entrypoints.batch_runner import input_result_keys, result_key
    from batchgen.entrypoints.openai_protocol import (
        BatchLineError,
        batch_line_custom_id,
        parse_batch_line,
    )

    lines = [*MIXED, '{"prompt": "plain, no id"}', '{"custom_id": 7, "prompt": "x"}', "NaN"]
    lines += ['\ufeff{"custom_id": "bom", "prompt": "x"}', '{"custom_id": "\\ud800"}']
    src = write_lines(tmp_path / "mixed.jsonl", lines)
    out = tmp_path / "out.jsonl"
    run_batch_file(FakeEngine(), src, out, progress=False)
    written = {result_key(r) for r in read_results(out)}
    count, keys = input_result_keys(src)
    assert count == sum(1 for line in lines if line.strip())
    expected = {("id", i) for i in keys.done_ids} | {("line", n) for n in keys.done_lines}
    assert expected == written
    for number, raw in enumerate(lines, start=1):  # the same ids as the full parse
        try:
            full = parse_batch_line(raw, number).custom_id
        except BatchLineError as err:
            full = err.custom_id
        assert batch_line_custom_id(raw.encode(), number) == full, raw


@pytest.mark.timeout(60)
def test_two_jobs_on_one_uri_are_never_mixed(tmp_path):
    """The tester's case: job A (30 requests) opened the URI; job B (12 other requests under
    A's first 12 ids) replaced the manifest before A stored anything. A stops at its first
    segment with every result it finished in its output; B, restarted, restores its own 12
    results only; and results in the snapshot for ids B's input lacks are never written."""
    uri = f"file://{tmp_path / 'snap'}"
    big = write_lines(tmp_path / "big.jsonl", [completion_line(f"c{i:02d}") for i in range(30)])
    small = write_lines(
        tmp_path / "small.jsonl", [completion_line(f"c{i:02d}", max_tokens=2) for i in range(12)]
    )

    def writer(src: Path) -> SnapshotWriter:
        store = SnapshotStore(uri)
        store.open_job(manifest(input_sha256=src.name.ljust(64, "0"), input_name=src.name))
        return SnapshotWriter(store, max_results=4, max_age_s=3600)

    a = writer(big)
    b = writer(small)  # replaces A's manifest: A stored nothing yet
    with pytest.raises(SnapshotTakenOverError, match="input 'small.jsonl'"):
        run_batch_file(FakeEngine(), big, tmp_path / "a.jsonl", progress=False, snapshot=a)
    assert len(read_results(tmp_path / "a.jsonl")) == 4  # A's results so far: in its output
    assert list(SnapshotStore(uri).iter_result_lines()) == []
    run_batch_file(FakeEngine(per_step=2), small, tmp_path / "b1.jsonl", progress=False, snapshot=b)
    # Another job's results stored under B's manifest anyway (by an older batchgen, say).
    b.store.write_segment(99, "beef", [result_line("c00", "A's text"), result_line("zz-1")])
    summary = run_batch_file(
        FakeEngine(per_step=2), small, tmp_path / "b2.jsonl", progress=False, snapshot=writer(small)
    )
    assert (summary.restored, summary.skipped, summary.succeeded, summary.ignored) == (12, 12, 0, 1)
    assert "1 snapshot results ignored (no such request in the input)" in summary.describe()
    results = read_results(tmp_path / "b2.jsonl")
    assert sorted(r["custom_id"] for r in results) == [f"c{i:02d}" for i in range(12)]

    def text(result: dict) -> str:
        return result["response"]["body"]["choices"][0]["text"]

    assert {text(r) for r in results} == {text(read_results(tmp_path / "b1.jsonl")[0])}
    assert len(text(results[0])) == 2  # B's max_tokens, not A's


@pytest.mark.timeout(60)
def test_resume_and_the_snapshot_together_give_each_result_once(tmp_path):
    """A run killed between writing results to its output and storing them: --resume on
    that output stores the missing ones, and copies the ones only the snapshot has."""
    src, uri = _job(tmp_path), f"file://{tmp_path / 'snap'}"
    out = tmp_path / "out.jsonl"
    with pytest.raises(Stop):
        run_batch_file(FakeEngine(per_step=2, crash_after=3), src, out, progress=False)
    local_only = out.read_bytes()  # 6 results the snapshot never saw
    snap = _writer(uri, src)
    for i in (4, 5, 6, 7):  # two the output has too, two it lacks
        snap.add(result_line(f"c{i:02d}", "from the snapshot"))
    snap.flush()
    summary = run_batch_file(
        FakeEngine(per_step=2),
        src,
        out,
        resume=True,
        progress=False,
        snapshot=_writer(uri, src),
    )
    assert (summary.restored, summary.succeeded) == (2, 4)
    results = read_results(out)
    assert Counter(r["custom_id"] for r in results) == Counter(f"c{i:02d}" for i in range(12))
    assert out.read_bytes().startswith(local_only)
    stored = [json.loads(line) for line in SnapshotStore(uri).iter_result_lines()]
    assert Counter(r["custom_id"] for r in stored) == Counter(f"c{i:02d}" for i in range(12))
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in results}
    assert texts["c06"] == texts["c07"] == "from the snapshot"
    assert texts["c04"] != "from the snapshot"  # the output's own copy wins


@pytest.mark.timeout(60)
def test_batchgen_run_takes_the_uri_from_the_cluster_file_and_keeps_it_from_the_engine(
    tmp_path, monkeypatch, capsys
):
    src, snap = _job(tmp_path, 3), tmp_path / "snap"
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "batchgen_cluster:\n  model: tiny\n  checkpoint_service:\n"
        f"    snapshot_storage_uri: '{snap}'\n    snapshot_interval_results: 2\n"
    )
    given: dict = {}

    def fake_start(kwargs):
        given.update(kwargs)
        return FakeEngine()

    monkeypatch.setattr(cli_flags, "start_engine", fake_start)
    argv = ["run", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--no-progress"]
    assert cli.main([*argv, "--config", str(config)]) == 0
    assert given["snapshot_storage_uri"] is None and given["snapshot_interval_results"] is None
    store = SnapshotStore(str(snap))
    assert len(list(store.iter_result_lines())) == 3 and len(store.segments()) == 2
    assert store.read_manifest().model == "tiny"
    # Another model on the same URI: refused before the engine starts.
    given.clear()
    assert cli.main([*argv, "--config", str(config), "--model", "other"]) == 2
    assert "it differs in model: snapshot 'tiny', this run 'other'" in capsys.readouterr().err
    assert given == {}


@pytest.mark.timeout(60)
def test_a_store_that_fails_mid_run_stops_the_run_and_resume_completes_it(tmp_path, monkeypatch):
    src, uri = _job(tmp_path), f"file://{tmp_path / 'snap'}"
    out = tmp_path / "out.jsonl"
    snap = _writer(uri, src, max_results=2, max_age_s=3600)
    real_write, calls = snap.store.write_segment, []

    def flaky(*args):
        calls.append(args)
        if len(calls) > 1:
            raise OSError("the network is down")
        return real_write(*args)

    monkeypatch.setattr(snap.store, "write_segment", flaky)
    with pytest.raises(OSError, match="the network is down"):
        run_batch_file(FakeEngine(per_step=2), src, out, progress=False, snapshot=snap)
    assert len(read_results(out)) == 4 and len(list(SnapshotStore(uri).iter_result_lines())) == 2
    summary = run_batch_file(
        FakeEngine(per_step=2), src, out, resume=True, progress=False, snapshot=_writer(uri, src)
    )
    assert (summary.skipped, summary.restored, summary.succeeded) == (4, 0, 8)
    expected = Counter(f"c{i:02d}" for i in range(12))
    assert Counter(r["custom_id"] for r in read_results(out)) == expected
    stored = SnapshotStore(uri).iter_result_lines()
    assert Counter(json.loads(line)["custom_id"] for line in stored) == expected


@pytest.mark.timeout(60)
def test_a_store_unwritable_mid_run_says_where_the_results_are(tmp_path, monkeypatch, capsys):
    src, snap, out = _job(tmp_path), tmp_path / "snap", tmp_path / "out.jsonl"
    monkeypatch.setattr(cli_flags, "start_engine", lambda kwargs: FakeEngine(per_step=2))
    real_put = SnapshotStore._put

    def put(self, path, data):  # the store turns read-only after its first segment
        if "/results/" in path and self.segments():
            raise PermissionError(1, "Operation not permitted", f"{path}.tmp-0123")
        return real_put(self, path, data)

    monkeypatch.setattr(SnapshotStore, "_put", put)
    argv = ["run", "-i", str(src), "-o", str(out), "--no-progress", "--model", "tiny"]
    argv += ["--snapshot-storage-uri", str(snap), "--snapshot-interval-results", "2"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"error: could not write the snapshot at {snap} (PermissionError: [Errno 1] " in err
    assert "every result finished so far is in the output file: rerun with --resume" in err
    assert len(read_results(out)) == 4
    assert len(list(SnapshotStore(str(snap)).iter_result_lines())) == 2
    monkeypatch.setattr(SnapshotStore, "_put", real_put)  # writable again
    assert cli.main([*argv, "--resume"]) == 0
    expected = Counter(f"c{i:02d}" for i in range(12))
    assert Counter(r["custom_id"] for r in read_results(out)) == expected
    stored = SnapshotStore(str(snap)).iter_result_lines()
    assert Counter(json.loads(line)["custom_id"] for line in stored) == expected


# ---- batchgen run, killed with SIGKILL and restarted elsewhere


def _env(tmp_path: Path, **extra: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", BATCHGEN_CACHE_DIR=str(tmp_path / "cache"))
    for name in ("VIRTUAL_ENV", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        env.pop(name, None)
    return {**env, **extra}


def _requests(path: Path, n: int) -> list[str]:
    ids = [f"req-{i:03d}" for i in range(n)]
    lines = []
    for i, cid in enumerate(ids):
        body = {"prompt": f"prompt {i} " * (1 + i % 5), "max_tokens": 24, "temperature": 0}
        body["ignore_eos"] = True
        lines.append(json.dumps({"custom_id": cid, "url": "/v1/completions", "body": body}))
    write_lines(path, lines)
    return ids


def _kill_and_restart(tmp_path: Path, model: Path, uri: str, store: SnapshotStore, env: dict):
    inp = tmp_path / "in.jsonl"
    ids = _requests(inp, 48)
    args = ["--model", str(model), "--no-progress", "--max-in-flight", "4"]
    args += ["--snapshot-storage-uri", uri, "--snapshot-interval-results", "4"]
    killed_out = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(
        [*BATCHGEN, "run", "-i", str(inp), "-o", str(killed_out), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None and not store.segments():
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    before = list(store.iter_result_lines())
    assert 1 <= len(before) < len(ids), "the kill should land mid-run"
    # Restart "on another machine": a new, empty output path, the same URI and settings.
    new_out = tmp_path / "elsewhere" / "results.jsonl"
    new_out.parent.mkdir()
    done = subprocess.run(
        [*BATCHGEN, "run", "-i", str(inp), "-o", str(new_out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{len(before)} of them restored from the snapshot" in done.stderr
    lines = new_out.read_bytes().splitlines(keepends=True)
    results = [json.loads(line) for line in lines]
    assert Counter(r["custom_id"] for r in results) == Counter(ids)  # exactly once
    assert all(r["error"] is None for r in results)
    assert set(before) <= set(lines)  # the results stored before the kill, byte for byte
    stored = [json.loads(line)["custom_id"] for line in store.iter_result_lines()]
    assert Counter(stored) == Counter(ids)
    assert store.read_progress()["finished"] is True
    return inp, args


@pytest.mark.timeout(600)
def test_sigkill_then_restart_from_a_file_uri(tmp_path, checkpoint_dir):
    snap = tmp_path / "snap"
    uri = f"file://{snap}"
    inp, args = _kill_and_restart(
        tmp_path, checkpoint_dir("mixtral"), uri, SnapshotStore(uri), _env(tmp_path)
    )
    # The same URI with another job's settings fails before any model loads.
    proc = subprocess.run(
        [*BATCHGEN, "run", "-i", str(inp), "-o", str(tmp_path / "x.jsonl"), *args, "--seed", "7"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "holds the snapshot of another job; it differs in seed: snapshot 0, this run 7" in (
        proc.stderr
    )
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.timeout(600)
def test_sigkill_then_restart_from_a_local_s3_server(tmp_path, checkpoint_dir, s3_endpoint):
    uri = f"s3://{BUCKET}/jobs/sigkill/"
    env = _env(tmp_path, AWS_ENDPOINT_URL=s3_endpoint, **CREDENTIALS)
    _kill_and_restart(
        tmp_path, checkpoint_dir("mixtral"), uri, SnapshotStore(uri, s3_options(s3_endpoint)), env
    )


# ---- what identifies the job: the model's files, the settings as resolved


def _copy_model(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.timeout(120)
def test_a_checkpoint_is_identified_by_its_files_not_its_folder_name(tmp_path, checkpoint_dir):
    from batchgen.config import EngineConfig
    from batchgen.entrypoints.snapshot_store import job_manifest

    inp = _job(tmp_path, 3)
    mixtral = _copy_model(checkpoint_dir("mixtral"), tmp_path / "a" / "model")
    llama = _copy_model(checkpoint_dir("llama"), tmp_path / "b" / "model")
    copy = _copy_model(mixtral, tmp_path / "c" / "model")

    def job(model: Path) -> Manifest:
        return job_manifest(inp, EngineConfig(model=str(model), device="cpu"))

    first = job(mixtral)
    fingerprint = first.model_fingerprint
    assert first.model == "model" and fingerprint["architecture"] == "MixtralForCausalLM"
    assert fingerprint["num_local_experts"] == 4 and len(fingerprint["config_sha256"]) == 64
    weights = {p.name: p.stat().st_size for p in mixtral.glob("*.safetensors")}
    assert fingerprint["weights"] == weights and weights
    store = SnapshotStore(str(tmp_path / "snap"))
    store.open_job(first)
    store.write_segment(1, "aa", [result_line("c00")])
    with pytest.raises(SnapshotError) as err:
        SnapshotStore(str(tmp_path / "snap")).open_job(job(llama))
    text = str(err.value)
    assert "model architecture: snapshot 'MixtralForCausalLM', this run 'LlamaForCausalLM'" in text
    assert "model config.json: snapshot sha256 " in text and "model weights: snapshot " in text
    assert "model: snapshot" not in text  # the same folder name
    SnapshotStore(str(tmp_path / "snap")).open_job(job(copy))  # a real copy is the same model
    # Same config, other weights (another training run): the weights' sizes tell them apart.
    retrained = _copy_model(mixtral, tmp_path / "d" / "model")
    shard = sorted(retrained.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes() + b"\0" * 8)
    with pytest.raises(SnapshotError, match=f"model weights: snapshot {shard.name} \\("):
        SnapshotStore(str(tmp_path / "snap")).open_job(job(retrained))


@pytest.mark.timeout(120)
def test_settings_are_compared_as_the_engine_resolves_them(tmp_path, checkpoint_dir):
    from types import SimpleNamespace

    import torch

    from batchgen.config import EngineConfig
    from batchgen.entrypoints.snapshot_store import job_manifest

    inp = _job(tmp_path, 3)
    model = checkpoint_dir("mixtral")
    limit = json.loads((model / "config.json").read_text())["max_position_embeddings"]

    def job(**settings) -> Manifest:
        return job_manifest(inp, EngineConfig(model=str(model), device="cpu", **settings))

    default = job()
    assert default.settings == {
        "dtype": "float32",
        "kv_cache_dtype": "auto",
        "max_model_len": limit,
        "seed": 0,
        "tokenizer": None,
    }
    spelled_out = job(dtype="float32", max_model_len=limit, tokenizer=str(model))
    assert default.differences(spelled_out) == []
    tokenizer = _copy_model(model, tmp_path / "tokenizers" / "my-tok")
    assert job(tokenizer=str(tokenizer)).settings["tokenizer"] == "my-tok"  # its name, no path
    assert default.differences(job(dtype="bfloat16", max_model_len=limit // 2)) == [
        "dtype: snapshot 'float32', this run 'bfloat16'",
        f"max_model_len: snapshot {limit}, this run {limit // 2}",
    ]
    if not torch.cuda.is_available():  # Ray may put "auto" ranks on GPUs: left unresolved
        ray = SimpleNamespace(distributed_executor_backend="ray")
        config = EngineConfig(model=str(model))
        assert job_manifest(inp, config, ray).settings["dtype"] == "auto"
        assert job_manifest(inp, config).settings["dtype"] == "float32"


@pytest.mark.timeout(120)
def test_kv_cache_dtype_is_part_of_the_job(tmp_path, checkpoint_dir):
    """An fp8 or bf16 KV cache changes the tokens, so a job resumed with another kv_cache_dtype
    would mix the results of two numerics in one output: refused as the dtype is. ``auto`` and
    the model's dtype by name are one job, ``fp8`` and ``fp8_e4m3`` are, and a manifest written
    before the setting existed (no key) was an ``auto`` job."""
    import dataclasses

    from batchgen.config import EngineConfig
    from batchgen.entrypoints.snapshot_store import job_manifest

    inp = _job(tmp_path, 3)
    model = checkpoint_dir("mixtral")

    def job(**settings) -> Manifest:
        return job_manifest(inp, EngineConfig(model=str(model), device="cpu", **settings))

    auto, fp8 = job(), job(kv_cache_dtype="fp8")
    assert auto.differences(fp8) == ["kv_cache_dtype: snapshot 'auto', this run 'fp8_e4m3'"]
    assert fp8.differences(job(kv_cache_dtype="fp8_e4m3")) == []
    assert auto.differences(job(kv_cache_dtype="bfloat16")) == [
        "kv_cache_dtype: snapshot 'auto', this run 'bfloat16'"  # under a float32 model
    ]
    assert job(dtype="bfloat16").differences(job(dtype="bfloat16", kv_cache_dtype="bfloat16")) == []
    old = dataclasses.replace(
        auto, settings={k: v for k, v in auto.settings.items() if k != "kv_cache_dtype"}
    )
    assert old.differences(auto) == [] and auto.differences(old) == []
    assert old.differences(fp8) == ["kv_cache_dtype: snapshot 'auto', this run 'fp8_e4m3'"]
    store = SnapshotStore(str(tmp_path / "snap"))
    store.open_job(auto)
    store.write_segment(1, "aa", [result_line("c00")])
    with pytest.raises(SnapshotError, match="kv_cache_dtype: snapshot 'auto', this run 'fp8_e4m3'"):
        SnapshotStore(str(tmp_path / "snap")).open_job(fp8)
