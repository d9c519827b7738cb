"""Per-request sampling settings, with vLLM's names and semantics (`vllm.SamplingParams`).

Pure Python (no torch), so that a client process can build requests without the engine.
The checks of single fields and the bounds (``MAX_N``, ``MAX_LOGPROBS``, ...) are in
`batchgen.sampling_params_checks`; the bounds are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from batchgen.sampling_params_checks import (  # noqa: F401 (bounds re-exported)
    GREEDY_TEMPERATURE_EPS,
    MAX_INT64,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    check_bad_words,
    check_float,
    check_int,
    check_logit_bias,
    check_stop_strings,
    check_stop_token_ids,
    check_structured_outputs,
    is_int,
    raise_field_error,
    short_repr,
)
from batchgen.structured.params import StructuredOutputsParams


class SamplingType(IntEnum):
    """How the sampler picks a request's tokens (vLLM's `SamplingType`)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to sample the completions of one request. Validated on construction.

    Attributes:
        n: number of samples (completions) to generate for the prompt, >= 1.
        temperature: softmax temperature in [0, 1e4]; below 1e-5 the request is greedy (argmax).
        top_p: nucleus sampling, in (0, 1]: keep the smallest set of most likely tokens whose
            cumulative probability reaches ``top_p`` (the most likely token is always kept).
            1 disables it.
        top_k: keep only the ``top_k`` most likely tokens (ties with the k-th are kept too).
            0 or -1 disables it (-1 is accepted like vLLM and stored as 0); a value larger than
            the vocabulary also disables it. At most ``MAX_INT64`` (2**63 - 1).
        min_p: in [0, 1]: drop tokens whose probability is below ``min_p`` times the
            probability of the most likely token. 0 disables it.
        seed: seed of this request's own random generator, so that its samples are reproducible
            and independent of the other requests in the batch; any integer (it is hashed to 64
            bits before use); None uses the engine's global generator.
        max_tokens: maximum number of tokens to generate per sample, in [1, 2**63 - 1]; None
            generates until ``max_model_len``.
        min_tokens: minimum number of tokens to generate before EOS or a ``stop_token_ids`` token
            may be sampled (those ids are masked out until then), in [0, 2**63 - 1] and
            <= ``max_tokens``.
        stop: string(s) that end a sample when they appear in its text; a single string is
            normalised to a one-element list, None to ``[]``. Empty strings are rejected.
        stop_token_ids: token ids in [0, 2**63 - 1] that end a sample when sampled (kept in the
            output token ids); None is normalised to ``[]``.
        ignore_eos: keep generating after the EOS token.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        logprobs: number of log-probabilities to return per generated token, in [0, 20], or
            None for none. N returns the N most likely tokens (with rank 1 = most likely) plus
            the sampled token with its rank if it is not among them; 0 returns only the sampled
            token. As in vLLM v1, log-probabilities are ``log_softmax`` of the raw model logits,
            before ``bad_words``, ``logit_bias``, penalties, temperature and top-k/top-p/min-p,
            so they do not depend on the sampling settings.
        prompt_logprobs: number of log-probabilities to return per prompt token, in [0, 20], or
            None for none (vLLM's ``prompt_logprobs``): for each prompt token after the first,
            the N most likely tokens at that position plus the actual prompt token with its
            rank (``RequestOutput.prompt_logprobs``; the first prompt token has None). Raw model
            distribution, like ``logprobs``. Such a request computes every prompt position itself:
            it takes no shared or cached prompt K/V until its prompt log-probabilities are known
            (a position read from another sequence's cache has no logits), so with ``n`` > 1 its
            other samples share the prompt only once the first has prefilled it.
        presence_penalty: in [-2, 2], subtracted once from the logit of every token that already
            appears in the generated output (OpenAI's definition; the prompt does not count).
        frequency_penalty: in [-2, 2], subtracted from a token's logit once per occurrence of it
            in the generated output (OpenAI's definition; the prompt does not count).
        repetition_penalty: in [1e-4, 1e4], the CTRL / Hugging Face penalty over tokens seen
            in the prompt
            *or* the output: positive logits are divided by it, negative ones multiplied. 1
            disables it; > 1 discourages repetition.
        skip_special_tokens: drop special tokens from the detokenized text.
        detokenize: turn the generated ids into text (vLLM's ``detokenize``). False leaves
            ``CompletionOutput.text`` empty and saves the incremental decode of every token
            (token-id workloads: RL rollouts, benchmarks); stop strings then cannot be
            matched, so ``stop`` must be empty (ValueError otherwise, as in vLLM).
            Log-probability entries still carry their token's text.
        structured_outputs: constrain every sample to a JSON schema, a JSON object, a regex, a
            choice or a grammar (`StructuredOutputsParams`, or a dict of its fields); each
            sample of ``n`` follows the grammar on its own. The spec is checked by the grammar
            engine here (an invalid schema, regex or grammar raises ValueError naming
            ``structured_outputs.<field>``). A constrained sample ends when its grammar is
            complete (``finish_reason`` "stop"); one cut by ``max_tokens`` ends with "length"
            and its text may be incomplete (e.g. unclosed JSON).
        logit_bias: token id -> bias added to that token's logit before sampling (OpenAI's
            ``logit_bias``; vLLM applies it the same way): each bias in [-100, 100]; -100 in
            practice bans the token, +100 forces it. Keys are token ids >= 0, ints or strings of
            decimal digits (JSON object keys are strings), normalised to ints; they must be below
            the model's vocabulary size, which the engine checks when it takes the request
            (`update_from_tokenizer`). None or ``{}``: no bias. The bias is added before the
            penalties, ``min_tokens``, the grammar mask, temperature, top-k/top-p/min-p and the
            greedy argmax; returned ``logprobs`` stay those of the raw model (see ``logprobs``).
        bad_words: words a sample must not generate (vLLM's ``bad_words``); None is normalised
            to ``[]``, and every word must hold a non-space character. Each word is tokenized
            (`update_from_tokenizer`, ``add_special_tokens=False``) without its leading spaces,
            and again with one leading space, the second form kept only when its first token
            differs from the first form's and it has as many tokens (how a word reads in the
            middle of text). A form's last token is banned (logit -inf) at a step when the
            sample's generated tokens end with the form's other tokens (a one-token form is
            always banned); the prompt does not count, as in vLLM. Applied first among the
            logits processors; returned ``logprobs`` stay the raw model's.

    Every numeric field is range-checked here, so that a value the engine's tensors cannot hold
    (``top_k=2**63``, an integer temperature of 400 digits) fails this request at the boundary
    rather than the engine step that every other request shares.

    Raises:
        ValueError: on a wrong type or an out-of-range value; the message names the field and
            its allowed range, e.g. ``"top_p must be in (0, 1], got 1.5"``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        self._validate_and_normalise()
        # Token-id forms of `bad_words`, set by `update_from_tokenizer` (vLLM keeps them alike).
        self._bad_words_token_ids: list[list[int]] | None = None if self.bad_words else []

    def _validate_and_normalise(self) -> None:
        self.n = check_int(self.n, "n", minimum=1)
        if self.n > MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        # Upper bounds keep the float32 sampler finite (1/temperature, logit/penalty).
        self.temperature = check_float(
            self.temperature,
            "temperature",
            f"[0, {MAX_TEMPERATURE:g}]",
            lambda x: 0 <= x <= MAX_TEMPERATURE,
        )
        self.top_p = check_float(self.top_p, "top_p", "(0, 1]", lambda x: 0 < x <= 1)
        if not is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT64:
            raise ValueError(
                "top_k must be an integer >= 1, or 0 or -1 to disable it, and at most "
                f"{MAX_INT64}, got {short_repr(self.top_k)}"
            )
        self.top_k = max(int(self.top_k), 0)
        self.min_p = check_float(self.min_p, "min_p", "[0, 1]", lambda x: 0 <= x <= 1)
        if self.seed is not None:
            self.seed = check_int(self.seed, "seed")
        if self.max_tokens is not None:
            self.max_tokens = check_int(
                self.max_tokens, "max_tokens", minimum=1, maximum=MAX_INT64, or_none=True
            )
        self.min_tokens = check_int(self.min_tokens, "min_tokens", minimum=0, maximum=MAX_INT64)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        self.stop = check_stop_strings(self.stop)
        self.stop_token_ids = check_stop_token_ids(self.stop_token_ids)
        flags = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize")
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                # ValueError for every invalid field, wrong types included (as vLLM does).
                value = getattr(self, name)
                raise ValueError(f"{name} must be a bool, got {value!r}")  # noqa: TRY004
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop strings need detokenize=True (no text is made without it), got "
                f"stop={self.stop!r} with detokenize=False"
            )
        if self.logprobs is not None:
            if not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, "
                    f"got {self.logprobs!r}"
                )
            self.logprobs = int(self.logprobs)
        if self.prompt_logprobs is not None:
            if not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, "
                    f"got {short_repr(self.prompt_logprobs)}"
                )
            self.prompt_logprobs = int(self.prompt_logprobs)
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_float(getattr(self, name), name, "[-2, 2]", lambda x: -2 <= x <= 2)
            setattr(self, name, value)
        self.repetition_penalty = check_float(
            self.repetition_penalty,
            "repetition_penalty",
            f"[{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]",
            lambda x: MIN_REPETITION_PENALTY <= x <= MAX_REPETITION_PENALTY,
        )
        if self.structured_outputs is not None:
            self.structured_outputs = check_structured_outputs(self.structured_outputs)
        self.logit_bias = check_logit_bias(self.logit_bias)
        self.bad_words = check_bad_words(self.bad_words)

    def update_from_tokenizer(self, tokenizer: object, vocab_size: int) -> None:
        """Check the token ids this request names against the model (vLLM's name for the step
        that needs the tokenizer). Called by the engine when it takes the request
        (`InputProcessor.process`); idempotent.

        Args:
            tokenizer: the model's tokenizer (``encode(text, add_special_tokens=False)``).
            vocab_size: the model's vocabulary size V; token ids must be in ``[0, V)``.

        Raises:
            ValueError: a ``logit_bias`` id outside ``[0, V)``, or a bad word that the tokenizer
                turns into no token or into ids outside ``[0, V)``; the error carries
                ``code = "invalid_request"`` and ``param`` ``"logit_bias"`` or ``"bad_words"``.
        """
        outside = sorted(t for t in self.logit_bias or () if t >= vocab_size)
        if outside:
            shown = ", ".join(map(str, outside[:5])) + (", ..." if len(outside) > 5 else "")
            raise_field_error(
                "logit_bias",
                f"logit_bias keys must be token ids in [0, {vocab_size}) (the model's "
                f"vocabulary), got {shown}",
            )
        forms: list[list[int]] = []
        for word in self.bad_words:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not plain or not all(is_int(t) and 0 <= t < vocab_size for t in plain + spaced):
                raise_field_error(
                    "bad_words",
                    f"bad_words entry {short_repr(word)} must tokenize to token ids in "
                    f"[0, {vocab_size}), got {short_repr(plain)}",
                )
            forms.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                forms.append(spaced)
        self._bad_words_token_ids = forms

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The token-id forms of ``bad_words`` (see there), ``[]`` when there are none.

        Raises:
            RuntimeError: ``bad_words`` is set and `update_from_tokenizer` has not run.
        """
        if self._bad_words_token_ids is None:
            raise RuntimeError("bad_words need update_from_tokenizer(tokenizer) before sampling")
        return self._bad_words_token_ids

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        """True when any of the presence, frequency or repetition penalties is active."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
