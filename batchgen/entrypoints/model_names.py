"""Requests that name a model other than the served one.

OpenAI Batch files name OpenAI models (``"model": "gpt-4o-mini"``); BatchGen runs every request
on the model it serves, whatever the line names, and says so in the response's ``model``. So
that such a file does not run on the wrong model unnoticed, a run counts the lines naming each
other model and logs one warning per name at the end (`ModelNameTally.warn`).
"""

from __future__ import annotations

import logging
from collections import Counter


class ModelNameTally:
    """Counts the requests whose ``model`` differs from the served model's name.

    Args:
        served_name: the name the engine serves its model under (``LLMEngine.model_name``).
    """

    def __init__(self, served_name: str) -> None:
        self.served_name = served_name
        self.mismatched: Counter[str] = Counter()

    def add(self, model: str | None) -> None:
        """Count one request naming ``model`` (None, the field left out, and the served name
        are not counted)."""
        if model is not None and model != self.served_name:
            self.mismatched[model] += 1

    def messages(self) -> list[str]:
        """One line per mismatched model name, most frequent first, e.g. ``"12 lines name
        model 'gpt-4o-mini'; they ran on 'batchgen/default-mixtral-v1' (--served-model-name
        sets the name)"``."""
        out = []
        for model, count in self.mismatched.most_common():
            lines, verb = ("1 line names", "it") if count == 1 else (f"{count} lines name", "they")
            out.append(
                f"{lines} model {model!r}; {verb} ran on {self.served_name!r} "
                "(--served-model-name sets the name)"
            )
        return out

    def warn(self, logger: logging.Logger, where: str) -> None:
        """Log `messages` as warnings, each prefixed with ``where`` (e.g. the input path)."""
        for message in self.messages():
            logger.warning("%s: %s", where, message)
