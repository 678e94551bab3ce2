"""Structured outputs: constrain what a request generates to a JSON schema, a regex, a choice or a grammar.

`StructuredOutputsParams` (in SamplingParams) says what; `StructuredOutputs` (owned by the engine) compiles
it with the xgrammar grammar engine, keeps a matcher per request and fills the token masks the sampler
applies. See docs/structured-outputs.md.
"""

from stallfree.engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
