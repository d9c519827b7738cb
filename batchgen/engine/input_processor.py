"""Requests in, token ids out: tokenization, chat templates and the length checks that decide
whether a request can run at all (vLLM v1's ``InputProcessor``).

Kept apart from the engine so that a process without the model can do it: the data-parallel
frontend (`batchgen.distributed.frontend`) tokenizes and validates every request once, then
hands token ids to the rank that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchgen.engine.prompt_bounds import PromptBound
from batchgen.models.model_config import ModelConfig
from batchgen.sampling_params import SamplingParams

PromptType = str | list[int] | dict


@dataclass
class ProcessedPrompt:
    """A request's prompt after validation: its text (None when given as ids) and token ids."""

    prompt: str | None
    prompt_token_ids: list[int]


def load_tokenizer(path: str | Path):
    """The model's tokenizer (`transformers.AutoTokenizer`), with the length limit lifted:
    length limits are the engine's to enforce (per request, with a clear error); without this,
    transformers warns about "indexing errors" on every long prompt. Safe to use from several
    threads at once."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = 1 << 62
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # Without truncation or padding set, `encode` never changes the backend's state, so
        # worker threads may tokenize while the engine thread detokenizes (a tokenizer.json
        # that sets them would be reset by the first encode, racing with other threads).
        backend.no_truncation()
        backend.no_padding()
    return tokenizer


def eos_token_ids(path: str | Path, cfg: ModelConfig) -> frozenset[int]:
    """EOS ids from config.json and generation_config.json (which may list several)."""
    ids = set(cfg.eos_token_ids)
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(path)
        eos = gen.eos_token_id
        ids.update(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    except OSError:
        pass
    return frozenset(int(i) for i in ids)


def check_prompt_size(prompt: PromptType, max_model_len: int, bound: PromptBound) -> None:
    """The cheap half of `InputProcessor.process`: refuse, in O(1) and without tokenizing, a
    token-id list of ``max_model_len`` ids or more and a text longer than ``bound`` allows.
    Pure (no tokenizer), so a process that holds a large prompt (the HTTP service's body
    parser) can refuse it before handing it on.

    Raises:
        ValueError: with ``code = "context_length_exceeded"``.
    """
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
    if isinstance(prompt, (list, tuple)) and len(prompt) >= max_model_len:
        raise _too_long(
            f"prompt has {len(prompt)} tokens, which leaves no room to generate within "
            f"max_model_len={max_model_len} (prompt must be < max_model_len tokens)"
        )
    if isinstance(prompt, str) and len(prompt) > bound.max_chars:
        raise _too_long(bound.message(len(prompt), max_model_len))


def _too_long(message: str) -> ValueError:
    err = ValueError(message)
    err.code = "context_length_exceeded"  # as the OpenAI API reports a too-long prompt
    return err


class InputProcessor:
    """Tokenizes and validates prompts for one model.

    A prompt that cannot fit is refused before the expensive part: token-id lists by their
    length before their ids are checked, texts by their length in characters before the
    tokenizer runs (`prompt_bound`, see `batchgen.engine.prompt_bounds`).

    Args:
        tokenizer: a `transformers` tokenizer.
        vocab_size: the model's vocabulary size (token ids must be in ``[0, vocab_size)``).
        max_model_len: prompt plus completion limit, in tokens.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.prompt_bound = PromptBound.for_tokenizer(tokenizer, max_model_len)

    def process(
        self, prompt: PromptType, params: SamplingParams, *, max_tokens_must_fit: bool = False
    ) -> ProcessedPrompt:
        """Tokenize ``prompt`` and check that it can run (see `LLMEngine.add_request`).

        Thread-safe (it only reads the tokenizer), so it may run off the engine thread.

        Raises:
            ValueError: empty prompt, prompt of ``max_model_len`` tokens or more (or a text
                longer than `prompt_bound` allows, refused before tokenizing), ids outside
                the vocabulary, text that cannot be tokenized, (with
                ``max_tokens_must_fit``) prompt plus ``max_tokens`` beyond ``max_model_len``,
                or a sampling field naming ids outside the vocabulary
                (`SamplingParams.update_from_tokenizer`: ``param`` ``"logit_bias"``).
                Length errors carry ``code = "context_length_exceeded"`` (OpenAI's code) and
                the completion-length one ``param = "max_tokens"``.
        """
        params.update_from_tokenizer(self.tokenizer, self.vocab_size)
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        if len(ids) >= self.max_model_len:
            raise _too_long(
                f"prompt has {len(ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len} (prompt must be < max_model_len tokens)"
            )
        if (
            max_tokens_must_fit
            and params.max_tokens is not None
            and len(ids) + params.max_tokens > self.max_model_len
        ):
            err = ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(ids) + params.max_tokens} were requested ({len(ids)} in the prompt, "
                f"{params.max_tokens} for the completion); lower the completion's maximum "
                "tokens"
            )
            # The field to change and the error code, as the OpenAI API reports them.
            err.param = "max_tokens"
            err.code = "context_length_exceeded"
            raise err
        return ProcessedPrompt(text, ids)

    def check_size(self, prompt: PromptType) -> None:
        """`check_prompt_size` with this processor's limits."""
        check_prompt_size(prompt, self.max_model_len, self.prompt_bound)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("prompt dict must have 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token")
            return prompt, self._encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize, turning text the tokenizer cannot take (e.g. lone UTF-16 surrogates from
        JSON escapes like "\\ud800") into a ValueError for this request alone, and refusing
        text that cannot fit before the tokenizer runs."""
        self.check_size(text)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"prompt is not valid Unicode text ({exc.reason} at character {exc.start})"
            ) from None
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # tokenizers raises TypeError/Exception on odd input
            raise ValueError(f"prompt could not be tokenized: {exc}") from None

    def _check_ids(self, ids) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError("prompt_token_ids must be a list of integers")
        self.check_size(ids)  # before looking at each of maybe millions of ids
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        return list(ids)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation with the generation prompt appended (`render_chat`)."""
        return self.render_chat(messages).prompt_token_ids

    def render_chat(self, messages: list[dict]) -> ProcessedPrompt:
        """A conversation as the model reads it: the chat template's text with the generation
        prompt appended, and its token ids (vLLM returns that text as the chat's prompt).

        Raises ValueError when messages are malformed or the tokenizer has no chat template
        (that error has ``param`` ``"model"``: the messages are fine, the model cannot take them).
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise ValueError(
                    f"messages[{i}] must be an object with string 'role' and 'content'"
                )
        if not getattr(self.tokenizer, "chat_template", None):
            err = ValueError(
                "this model's tokenizer has no chat template, so it cannot take chat messages; "
                "send the text as a 'prompt' to /v1/completions (LLM.generate) instead, or give "
                "the engine a tokenizer that has one (--tokenizer / LLM(tokenizer=...), or a "
                "'chat_template' in the model's tokenizer_config.json)"
            )
            # As the OpenAI API answers a chat request to a model that is not a chat model.
            err.param = "model"
            err.code = "invalid_request"
            raise err
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja2 TemplateError from `raise_exception`, and the like
            raise ValueError(f"the model's chat template rejected the messages: {exc}") from None
        return ProcessedPrompt(text, self._encode(text, add_special_tokens=False))
