"""An example group scorer behind HTTP, for `rollout.group_reward: http`.

Run it, then point a run at it:

    python examples/group_reward.py --port 8399 &
    verst train examples/group_reward.yaml

It answers `POST /score` (the body `verst.rollout.group_reward.HttpGroupScorer` posts) with
one reward per response, judged against the whole group: 1.0 for a right answer, plus 0.5 for
the right answers that are the shortest in their group, so the policy learns to stop early.
A reward model served over HTTP would take its place.
"""

from __future__ import annotations

import argparse

from aiohttp import web


def score(body: dict) -> list[float]:
    label = str(body["label"]).strip()
    responses = [str(r).strip() for r in body["responses"]]
    right = [r == label for r in responses]
    lengths = [len(ids) for ids in body["response_ids"]]
    shortest = min((n for n, ok in zip(lengths, right, strict=True) if ok), default=None)
    return [
        float(ok) + (0.5 if ok and n == shortest else 0.0)
        for ok, n in zip(right, lengths, strict=True)
    ]


async def handle(request: web.Request) -> web.Response:
    try:
        body = await request.json()
        return web.json_response({"rewards": score(body)})
    except (ValueError, KeyError, TypeError) as error:
        return web.json_response({"error": f"bad request: {error!r}"}, status=400)


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/score", handle)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8399)
    args = parser.parse_args()
    web.run_app(make_app(), host=args.host, port=args.port)
