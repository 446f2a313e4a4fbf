"""An example generate function (`rollout.generate_function: examples.generate_function:two_turns`).

A generate function owns one sample's tokens and episode loop. This one plays two turns: the
model answers, the environment replies with a fixed text ("\\ncheck: "), and the model answers
again, seeing its first answer. The environment's tokens get loss mask 0 (the model did not
sample them) and log-prob 0.0; the reward reads the last turn's text.
"""

from __future__ import annotations

import copy

from verst.engine import GenerateRequest, SamplingParams
from verst.models.tiny import build_char_tokenizer
from verst.plugins import Decode, FleetGenerator
from verst.rollout.generate import STATUS_OF_FINISH, output_versions
from verst.types import Sample

# The environment's reply, in the tiny model's character tokenizer (a real environment encodes
# its reply with the policy's tokenizer).
FEEDBACK = build_char_tokenizer().encode("\ncheck: ")


async def two_turns(
    engine: FleetGenerator, sample: Sample, params: SamplingParams, decode: Decode
) -> Sample:
    prompt = list(sample.prompt_tokens)
    key = str(hash(tuple(prompt)))  # the samples of one prompt share a routing key
    tokens, mask, logprobs, versions = list(prompt), [], [], []
    for turn in range(2):
        if turn:
            tokens += FEEDBACK
            mask += [0] * len(FEEDBACK)
            logprobs += [0.0] * len(FEEDBACK)
        request = GenerateRequest(input_ids=list(tokens), sampling_params=copy.copy(params))
        out = await engine.agenerate(request, key=key)
        tokens += out.output_ids
        mask += [1] * len(out.output_ids)
        logprobs += list(out.output_token_logprobs)
        versions += output_versions(out)
    sample.tokens = tokens
    sample.response_length = len(tokens) - len(prompt)
    sample.loss_mask = mask
    sample.rollout_logprobs = logprobs
    sample.weight_versions = sorted(set(versions))
    sample.status = STATUS_OF_FINISH[out.finish_reason]
    sample.metadata["response_text"] = decode(list(out.output_ids))
    return sample
