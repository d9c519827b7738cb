"""The module splits of this round (service/store.py, service/engine_loop.py, service/client.py,
sampling_params.py, parallel_config.py, distributed/rank_set.py) keep every public name
importable from the old module, as the same object as in its new home, and keep the log names of
the messages they moved."""

from __future__ import annotations

import importlib
import logging
import pickle

import pytest

# Every public top-level name each module defined before the split (commit 60ae9ee, by ast).
OLD_PUBLIC_NAMES = {
    "batchgen.service.store": [
        "BATCH_ID_RE", "BLOB_DIR", "CANCELLED", "CANCELLING", "COMPLETED", "DB_NAME", "EXPIRED",
        "FAILED", "FILE_ID_RE", "FINALIZING", "FinishedRequest", "IN_PROGRESS", "InputRow",
        "PENDING", "PendingRequest", "REQUEST_FAILED", "SCHEMA_VERSION", "SUCCEEDED", "Store",
        "StoredResult", "TERMINAL_STATUSES", "VALIDATING", "new_batch_id", "new_file_id",
    ],
    "batchgen.service.engine_loop": [
        "EngineLoop", "LoopStats", "OnlineEvent", "OnlineRequest", "StreamDelta", "logger",
    ],
    "batchgen.service.client": [
        "BatchGenClient", "BatchGenError", "BatchJob", "BatchResult", "CHAT_COMPLETIONS_URL",
        "COMPLETIONS_URL", "EndpointLines", "SUPPORTED_URLS", "TERMINAL_STATUSES",
        "line_endpoint", "logger", "split_by_endpoint",
    ],
    "batchgen.sampling_params": [
        "GREEDY_TEMPERATURE_EPS", "MAX_INT64", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_N",
        "MAX_REPETITION_PENALTY", "MAX_TEMPERATURE", "MIN_REPETITION_PENALTY", "SamplingParams",
        "SamplingType",
    ],
    "batchgen.parallel_config": [
        "DECODE_STRATEGIES", "EXECUTOR_BACKENDS", "LOAD_BALANCE_METHODS", "MAX_RANKS",
        "PREFILL_STRATEGIES", "ParallelConfig", "SEGMENT_MAX_AGE_S", "SEGMENT_MAX_RESULTS",
        "check_tensor_parallel_size",
    ],
    # rank_set.py before its messaging moved to rank_messages.py (commit 491e313): its own names
    # and the imported ones that other modules import or tests patch from it.
    "batchgen.distributed.rank_set": [
        "MIN_CONNECT_TIMEOUT_S", "RankFailedError", "RankHandle", "RankSet",
        "START_SHUTDOWN_GRACE_S", "logger", "start_local_ranks",
    ],
}
# The split-off modules, by the module they came out of.
NEW_MODULES = {
    "batchgen.service.store_schema": "batchgen.service.store",
    "batchgen.service.store_requests": "batchgen.service.store",
    "batchgen.service.engine_loop_records": "batchgen.service.engine_loop",
    "batchgen.service.engine_loop_inputs": "batchgen.service.engine_loop",
    "batchgen.service.engine_loop_outputs": "batchgen.service.engine_loop",
    "batchgen.service.client_jobs": "batchgen.service.client",
    "batchgen.service.client_input": "batchgen.service.client",
    "batchgen.sampling_params_checks": "batchgen.sampling_params",
    "batchgen.parallel_config_checks": "batchgen.parallel_config",
    "batchgen.distributed.rank_messages": "batchgen.distributed.rank_set",
}


@pytest.mark.parametrize("module", sorted(OLD_PUBLIC_NAMES))
def test_every_old_public_name_still_imports_from_the_old_module(module):
    old = importlib.import_module(module)
    missing = [name for name in OLD_PUBLIC_NAMES[module] if not hasattr(old, name)]
    assert not missing, f"{module} lost {missing}"
    for name in OLD_PUBLIC_NAMES[module]:  # `from module import name` works too
        namespace: dict = {}
        exec(f"from {module} import {name}", namespace)
        assert namespace[name] is getattr(old, name)


def test_a_moved_name_is_the_same_object_in_its_new_home():
    """A name defined in a split-off module and re-exported by the old one is one object (an
    ``isinstance`` check against either import agrees)."""
    shared = 0
    for new_name, old_name in NEW_MODULES.items():
        new, old = importlib.import_module(new_name), importlib.import_module(old_name)
        for name in OLD_PUBLIC_NAMES[old_name]:
            if hasattr(new, name) and name != "logger":
                assert getattr(new, name) is getattr(old, name), (new_name, name)
                shared += 1
    assert shared > 10  # the moved names were found, the loop is not vacuous


def test_rank_set_keeps_every_method_it_defined_before_its_split():
    """`RankSet` gets its messaging from the mixin `RankMessages` now; every method its class
    body defined before (commit 491e313, by ast) is still there, and the moved ones are the
    mixin's own (not shadowed by a stale copy)."""
    from batchgen.distributed.rank_messages import RankMessages
    from batchgen.distributed.rank_set import RankSet

    before = [
        "__init__", "_accept", "_can_replace", "_collect", "_connect_timeout", "_joined_again",
        "_kill", "_launch", "_listen", "_num_local", "_set_up", "_sort", "_start",
        "_take_joining", "_wait_ready", "_worlds", "broadcast", "joining", "max_model_len",
        "receive", "replace", "restartable", "send", "shutdown", "take_held",
    ]
    assert [name for name in before if not hasattr(RankSet, name)] == []
    moved = ["send", "broadcast", "receive", "take_held", "_collect", "_sort"]
    assert all(getattr(RankSet, name) is getattr(RankMessages, name) for name in moved)


def test_log_names_are_unchanged():
    from batchgen.service import client, engine_loop, engine_loop_inputs

    assert engine_loop.logger.name == "batchgen.service.engine_loop"
    assert engine_loop_inputs.logger.name == "batchgen.service.engine_loop"
    assert client.logger.name == "batchgen.service.client"
    assert logging.getLogger("batchgen.service.engine_loop") is engine_loop.logger


def test_sampling_params_and_parallel_config_still_pickle():
    """Moving checks out of the modules must not change what a pickled object needs (the
    process-based executors send SamplingParams to workers)."""
    from batchgen.parallel_config import ParallelConfig
    from batchgen.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, stop=["x"], seed=3)
    back = pickle.loads(pickle.dumps(params))
    assert vars(back) == vars(params)
    config = ParallelConfig()
    assert vars(pickle.loads(pickle.dumps(config))) == vars(config)
