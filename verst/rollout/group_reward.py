"""Group rewards (`rollout.group_reward`): one call scores every sample of a prompt.

`HttpGroupScorer` is the built-in `http`: it posts each group to `rollout.group_reward_url`
(a reward model or judge behind any HTTP server) and reads one reward per sample back:

    POST <url>  {"prompt": ..., "label": ..., "responses": ["text", ...],
                 "response_ids": [[id, ...], ...], "metadata": [{...}, ...]}
    200         {"rewards": [1.0, 0.0, ...]}        (one number per response, in order)

Any other status, a body without a `rewards` list, or no answer within the scorer's deadline
is an error of that group (its samples are FAILED by `verst.rollout.rewards.RewardScorer`),
never of the run.
"""

from __future__ import annotations

from typing import Any

from verst.plugin_loader import PluginError, load_plugin
from verst.plugins import GroupRewardFunction
from verst.types import Group

FIELD = "rollout.group_reward"
HTTP = "http"


class HttpGroupScorer:
    """Posts a group to `url` and returns the `rewards` list the server answers."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def __call__(self, group: Group) -> list[float]:
        import aiohttp

        first = group[0]
        body = {
            "prompt": first.prompt,
            "label": first.label,
            "responses": [str(s.metadata.get("response_text", "")) for s in group],
            "response_ids": [s.response_tokens for s in group],
            "metadata": [_jsonable(s.metadata) for s in group],
        }
        async with aiohttp.ClientSession() as client, client.post(self.url, json=body) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"{self.url} answered {r.status}: {text[:300]}")
            answer = await r.json(content_type=None)
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list):
            raise ValueError(f"{self.url} answered without a 'rewards' list: {text[:300]}")
        return rewards


def _jsonable(metadata: dict[str, Any]) -> dict[str, Any]:
    """The metadata entries a JSON body can carry (plain values), without the response text
    (sent as `responses`)."""
    plain = (str, int, float, bool, type(None), list, dict)
    return {k: v for k, v in metadata.items() if isinstance(v, plain) and k != "response_text"}


def load_group_reward(path: str, url: str | None) -> GroupRewardFunction:
    """`http` (with `url`), or any 'pkg.mod:fn' that takes a group; `PluginError` naming
    `rollout.group_reward` otherwise."""
    if path == HTTP:
        if not url:
            raise PluginError(f"{FIELD}: 'http' needs rollout.group_reward_url, the scorer's URL")
        return HttpGroupScorer(url)
    if ":" not in path and "." not in path:
        raise PluginError(
            f"{FIELD}: unknown group reward {path!r}: the built-in is 'http'; or give an import "
            "path 'pkg.mod:fn'"
        )
    return load_plugin(path, GroupRewardFunction, field=FIELD)
