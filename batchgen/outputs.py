"""Request outputs, with vLLM's names (`vllm.outputs.RequestOutput` / `CompletionOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token (natural log, float), with its rank in the distribution
    (1 = most likely) and its decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sample of a request.

    Attributes:
        index: sample index in ``[0, n)``.
        text: generated text (stop string removed unless ``include_stop_str_in_output``).
        token_ids: generated token ids, including a final EOS / stop token id if one ended it.
        cumulative_logprob: sum of the sampled tokens' log-probabilities (raw model
            distribution), or None when ``logprobs`` was not requested.
        logprobs: per generated token, a dict ``{token_id: Logprob}`` of the top-N tokens plus
            the sampled one; None when not requested.
        finish_reason: "stop" (EOS, stop token or stop string) or "length" (``max_tokens`` or
            ``max_model_len``); None while unfinished.
        stop_reason: the stop string or stop token id that ended the sample, None for EOS or
            length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request passed each point of its life (vLLM's ``RequestMetrics`` names).

    Times are seconds since the epoch (``time.time()``, as vLLM's); None until reached.

    Attributes:
        arrival_time: the engine accepted the request (`LLMEngine.add_request`).
        last_token_time: the latest token of any sample was generated.
        first_scheduled_time: a step first computed any of its tokens.
        first_token_time: its first output token (of any sample) was generated.
        time_in_queue: ``first_scheduled_time - arrival_time`` (seconds).
        finished_time: its last sample finished.
    """

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """All samples of one request, returned in input order by ``LLM.generate``.

    Attributes:
        request_id: the engine request id (string).
        prompt: the prompt text, or None when the prompt was given as token ids.
        prompt_token_ids: prompt token ids.
        outputs: ``n`` samples, ordered by ``index``.
        finished: True when every sample has finished.
        error: message when the request failed on its own (e.g. prompt longer than
            ``max_model_len``); the other requests are unaffected.
        metrics: the request's timestamps (`RequestMetrics`); None for a request that never
            entered the engine.
        prompt_logprobs: when ``SamplingParams.prompt_logprobs`` is set, one entry per prompt
            token: None for the first, then ``{token_id: Logprob}`` of the top-N tokens the model
            predicted at that position (ranks 1..N) plus the actual prompt token with its rank
            (vLLM's field); raw model distribution, floored at -9999. None otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
