"""BatchGen: throughput-first batch inference for Mixture-of-Experts language models.

The user API: ``LLM``, ``SamplingParams`` (with ``StructuredOutputsParams``), ``RequestOutput``,
``CompletionOutput`` and the service client ``BatchGenClient``.
"""

from batchgen.outputs import CompletionOutput, RequestOutput
from batchgen.sampling_params import SamplingParams
from batchgen.structured.params import StructuredOutputsParams

__version__ = "0.1.0"


def _apply_log_level_env() -> None:
    """``$BATCHGEN_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR, CRITICAL; any case) sets the
    ``batchgen`` logger's level in a Python program too, as ``VLLM_LOGGING_LEVEL`` does for
    vLLM (the ``batchgen`` commands also print INFO with it unset; a program sees WARNING and
    above through Python's last-resort handler). A bad value is a warning here, not an error:
    an import should not fail on it (the commands exit 2)."""
    import logging
    import os

    raw = os.environ.get("BATCHGEN_LOG_LEVEL", "").strip()
    if not raw:
        return
    levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    if raw.upper() in levels:
        logging.getLogger("batchgen").setLevel(raw.upper())
    else:
        import warnings

        warnings.warn(
            f"BATCHGEN_LOG_LEVEL={raw!r} ignored: expected one of {', '.join(levels)} (any case)",
            stacklevel=2,
        )


_apply_log_level_env()

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so that `import batchgen`
    # (e.g. for SamplingParams in a client process) stays light.
    if name == "LLM":
        import sys

        if "torch" not in sys.modules:  # OpenMP reads its wait policy when torch loads it
            from batchgen.engine.cpu_threads import set_openmp_wait_policy

            set_openmp_wait_policy()
        from batchgen.entrypoints.llm import LLM

        return LLM
    if name == "BatchGenClient":  # httpx only, no torch
        from batchgen.service.client import BatchGenClient

        return BatchGenClient
    raise AttributeError(name)
