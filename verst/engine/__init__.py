"""The inference engine: one continuous-batching `Scheduler` over a paged KV cache with a radix
prefix cache, called in-process (the embedded engine) or served behind SGLang's HTTP protocol
(`verst.engine.serving`, `verst.engine.server`). Requests and outputs use SGLang's field names."""

from verst.engine.requests import GenerateOutput, GenerateRequest
from verst.engine.sampling import SamplingParams, sample_next_tokens
from verst.engine.scheduler import Scheduler

__all__ = [
    "GenerateOutput",
    "GenerateRequest",
    "SamplingParams",
    "Scheduler",
    "sample_next_tokens",
]
