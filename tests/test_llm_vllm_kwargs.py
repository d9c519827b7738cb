"""vLLM's `LLM(...)` arguments without a BatchGen setting (`vllm_flags.take_vllm_kwargs`): a
no-op use runs (one INFO line), vLLM's default passes silently, any other use is refused with
the reason. Settings only: nothing is loaded (`make_configs`)."""

from __future__ import annotations

import logging

import pytest

from batchgen.entrypoints.llm import make_configs


def test_noop_uses_and_vllm_defaults_run(caplog):
    with caplog.at_level(logging.INFO, logger="batchgen"):
        engine, _ = make_configs(
            trust_remote_code=True,
            enable_chunked_prefill=True,
            swap_space=4,
            max_logprobs=20,
            tokenizer_mode="auto",
            revision=None,
            quantization=None,
            download_dir=None,
            disable_log_stats=False,
            max_num_seqs=3,
        )
    assert engine.max_num_seqs == 3
    noted = [r.getMessage() for r in caplog.records if "accepted with no effect" in r.getMessage()]
    assert [m.split(":")[0] for m in noted] == [
        "trust_remote_code=True",
        "enable_chunked_prefill=True",
        "swap_space=4",
        "max_logprobs=20",
        "tokenizer_mode='auto'",
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantization": "fp8"}, "vLLM's quantization='fp8' is not taken by BatchGen: quantized"),
        ({"revision": "v2"}, "(accepted only as revision='main'); download that revision"),
        ({"max_logprobs": 5}, "vLLM's max_logprobs=5 is not taken by BatchGen"),
        ({"enable_chunked_prefill": False}, "enable_chunked_prefill=False is not taken by"),
        ({"pipeline_parallel_size": 2}, "(accepted only as pipeline_parallel_size=1)"),
        ({"download_dir": "/data"}, "set HF_HUB_CACHE=DIR"),
        ({"trust_remote_code": "yes"}, "trust_remote_code must be True or False, got 'yes'"),
    ],
)
def test_other_uses_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match="^LLM argument") as caught:
        make_configs(**kwargs)
    assert message in str(caught.value)
