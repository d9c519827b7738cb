"""BatchGen: throughput-first batch inference for Mixture-of-Experts language models.

The user API: ``LLM``, ``SamplingParams`` (with ``StructuredOutputsParams``), ``RequestOutput``,
``CompletionOutput`` and the service client ``BatchGenClient``.
"""

from batchgen.outputs import CompletionOutput, RequestOutput
from batchgen.sampling_params import SamplingParams
from batchgen.structured.params import StructuredOutputsParams

__version__ = "0.1.0"

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
