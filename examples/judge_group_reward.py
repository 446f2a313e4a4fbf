"""A group reward scored by a judge model served by `verst serve`
(`rollout.group_reward: examples.judge_group_reward:judge_likelihood`).

The judge is any model behind `verst serve` (or an SGLang server: the same native `/generate`),
at `$VERST_JUDGE_URL` (default http://127.0.0.1:30001). For each response of the group it asks
for the log-probability of the response's tokens after the prompt (`logprob_start_len`, no
tokens generated) and scores the response by how much likelier the judge finds it than the
group's average: `mean log-prob − the group's mean of that`, so a group's rewards sum to 0 and
GRPO sees the judge's preference among the answers to one prompt. One HTTP request per
response, all sent together. The judge and the policy must share a tokenizer (the ids are sent
as they are).

    verst serve --model runs/judge_model --port 30001 &
    VERST_JUDGE_URL=http://127.0.0.1:30001 verst train examples/quickstart.yaml \\
        rollout.group_reward=examples.judge_group_reward:judge_likelihood

A judge that cannot be reached, or answers an error, fails the group (its samples FAILED,
`rollout/reward_errors`), never the run.
"""

from __future__ import annotations

import asyncio
import os
import statistics

import aiohttp

from verst.types import Group, Sample

DEFAULT_URL = "http://127.0.0.1:30001"
TIMEOUT_S = 30.0


async def _mean_logprob(session: aiohttp.ClientSession, url: str, sample: Sample) -> float:
    if sample.response_length == 0:
        return 0.0
    prompt_len = sample.prompt_length
    payload = {
        "input_ids": list(sample.tokens),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": prompt_len - 1,  # the first scored position predicts the response
    }
    async with session.post(f"{url}/generate", json=payload) as response:
        response.raise_for_status()
        body = await response.json()
    triples = body["meta_info"]["input_token_logprobs"]
    scored = [t[0] for t in triples if t[0] is not None][-sample.response_length :]
    return statistics.fmean(scored)


async def judge_likelihood(group: Group) -> list[float]:
    url = os.environ.get("VERST_JUDGE_URL", DEFAULT_URL).rstrip("/")
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        means = await asyncio.gather(*(_mean_logprob(session, url, s) for s in group))
    center = statistics.fmean(means)
    return [m - center for m in means]
