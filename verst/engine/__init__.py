"""The embedded inference engine: batched generation with per-token log-probs and versioned,
in-place weight updates, using SGLang's request / response field names."""

from verst.engine.core import Engine
from verst.engine.requests import GenerateOutput, GenerateRequest
from verst.engine.sampling import SamplingParams, sample_next_tokens

__all__ = [
    "Engine",
    "GenerateOutput",
    "GenerateRequest",
    "SamplingParams",
    "sample_next_tokens",
]
