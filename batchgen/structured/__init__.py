"""Structured outputs: constrained decoding to a JSON schema, a regex, a choice or a grammar.

One concern per module: `params` (the user's spec, vLLM's `StructuredOutputsParams`),
`grammar` (spec -> grammar engine text, and its check), `compiler` (compiled once per spec,
cached, on a worker thread), `matcher` (per-sample state and the batch bitmask), `manager` (the
engine's bookkeeping). The grammar engine is llguidance; see docs/structured-outputs.md.
"""

from batchgen.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
