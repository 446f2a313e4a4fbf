"""`verst serve`, `verst route` and `verst sessions`: the servers' commands (the engine, the
router and the session server), each a thin layer over the server's own `run_*` function."""

from __future__ import annotations

import argparse

from verst.chat.families import FAMILIES as CHAT_FAMILIES
from verst.chat.tool_parsers import TOOL_PARSERS
from verst.engine.config import QUANTIZATIONS
from verst.http_limits import add_limit_flags, limits_from_args

COMMANDS = ("serve", "route", "sessions")


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """The three servers' subcommands."""
    _serve_parser(subparsers)
    _route_parser(subparsers)
    _sessions_parser(subparsers)


def run_command(args: argparse.Namespace) -> int:
    """Run the server `args.command` names (one of `COMMANDS`) until it stops."""
    run = {"serve": _serve, "route": _route, "sessions": _sessions}[args.command]
    return run(args)


def _add_key_flags(parser: argparse.ArgumentParser, *, admin: bool = True) -> None:
    parser.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on every route but /health "
        "(default: $VERST_API_KEY; none = open)",
    )
    if admin:
        parser.add_argument(
            "--admin-api-key",
            help="the key control routes need instead (default: $VERST_ADMIN_API_KEY)",
        )


def _add_compute_flags(parser: argparse.ArgumentParser) -> None:
    """How `verst serve`'s engine computes: its forward, weights and steps."""
    parser.add_argument(
        "--true-on-policy",
        action="store_true",
        help="run every forward through the batch-invariant forward the trainer's true "
        "on-policy mode runs (log-probs bitwise equal to the trainer's)",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="fp8: the projections' weights in e4m3 with per-channel scales, made again at "
        "every weight update; GEMMs through torch._scaled_mm (default: %(default)s)",
    )
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, launch each decode-only step before reading the previous one's tokens "
        "(default: on; --no-overlap makes every decode step synchronous)",
    )


def _serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over SGLang's HTTP protocol with the embedded engine",
        description="Serve a local HF model directory with the embedded engine, speaking "
        "SGLang's native HTTP protocol (/generate, /update_weights_from_disk, ...) and the "
        "OpenAI-compatible /v1/completions and /v1/chat/completions.",
    )
    parser.add_argument("--model", required=True, help="local HF model directory")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the engine")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda:N")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    parser.add_argument("--served-model-name", help="the model name the API reports")
    parser.add_argument("--max-batch-size", type=int, default=256)
    _add_compute_flags(parser)
    parser.add_argument(
        "--num-threads", type=int, help="torch CPU threads (default: torch's own choice)"
    )
    parser.add_argument(
        "--parent-pid", type=int, help="stop when this process (the launcher) is gone"
    )
    parser.add_argument(
        "--max-n", type=int, default=1024, help="largest n (samples per prompt) accepted (400)"
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="format of tool calls in chat answers; default: the chat template family's "
        "(docs/engine_protocol.md)",
    )
    add_limit_flags(parser)
    _add_key_flags(parser)
    parser.add_argument(
        "--allowed-weight-dirs",
        default="",
        help="comma-separated directories /update_weights_from_disk may read under, besides "
        "the model's parent directory (symlinks out of them are refused)",
    )
    parser.add_argument(
        "--weight-group-timeout-s",
        type=float,
        default=30.0,
        help="how long /init_weights_update_group waits for the trainer's rendezvous",
    )
    parser.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=8,
        help="most LoRA adapters held at once (/load_lora_adapter); a batch mixes any of them",
    )
    parser.add_argument(
        "--lora-paths",
        nargs="*",
        default=[],
        metavar="NAME=DIR",
        help="peft adapter directories to hold from the start, each under NAME (lora_path)",
    )


def _route_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "route",
        help="route requests over engine servers with key affinity",
        description="Proxy SGLang-protocol requests to engine servers: requests with the same "
        "X-SMG-Routing-Key header reach the same engine; new keys go to the least-loaded one.",
    )
    parser.add_argument(
        "--engines", required=True, help="comma-separated engine URLs (URL@rank for a DP rank)"
    )
    parser.add_argument("--port", type=int, default=30100)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--sessions",
        action="store_true",
        help="refuse requests without X-SMG-Routing-Key instead of load-balancing them",
    )
    parser.add_argument("--health-interval-s", type=float, default=5.0)
    parser.add_argument(
        "--health-failures", type=int, default=3, help="failed health checks before removal"
    )
    add_limit_flags(parser)
    _add_key_flags(parser)


def _sessions_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sessions",
        help="serve token-in-token-out chat sessions for agents",
        description="An OpenAI-compatible chat API per session (base_url "
        "http://HOST:PORT/sessions/ID/v1) that records the exact token ids the engine saw and "
        "sampled and assembles them into training samples (POST /sessions/ID/samples).",
    )
    parser.add_argument(
        "--router", required=True, help="URL of a router (or a single engine) speaking /generate"
    )
    parser.add_argument(
        "--model", required=True, help="local HF model directory (its tokenizer and template)"
    )
    parser.add_argument("--port", type=int, default=30200)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", help="the model name the API reports")
    parser.add_argument(
        "--session-ttl-s",
        type=float,
        default=3600.0,
        help="a session unused this long is dropped (default 3600)",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=10000,
        help="most live sessions; creating one more answers 429 (default 10000)",
    )
    parser.add_argument(
        "--chat-family",
        choices=sorted(CHAT_FAMILIES),
        default=None,
        help="the chat template's family (turn framing, stop tokens, tool-call format); "
        "default: detected from the template (docs/chat_templates.md)",
    )
    add_limit_flags(parser)
    _add_key_flags(parser, admin=False)


def _serve(args: argparse.Namespace) -> int:
    import torch

    from verst.auth import ApiKeys
    from verst.engine.server.app import run_server

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    if args.device.startswith("cuda:"):
        # kernels launched without an explicit device (Triton, CUDA graphs) use the current one
        torch.cuda.set_device(torch.device(args.device))

    run_server(
        args.model,
        host=args.host,
        port=args.port,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        served_model_name=args.served_model_name,
        max_batch_size=args.max_batch_size,
        parent_pid=args.parent_pid,
        limits=limits_from_args(args),
        max_n=args.max_n,
        tool_call_parser=args.tool_call_parser,
        api_keys=ApiKeys.resolve(args.api_key, args.admin_api_key),
        allowed_weight_dirs=[d.strip() for d in args.allowed_weight_dirs.split(",") if d.strip()],
        group_join_timeout_s=args.weight_group_timeout_s,
        max_loras=args.max_loras_per_batch,
        lora_paths=_lora_paths(args.lora_paths),
        true_on_policy=args.true_on_policy,
        quantization=args.quantization,
        overlap=None if args.overlap else False,
    )
    return 0


def _lora_paths(pairs: list[str]) -> dict[str, str]:
    named = dict(pair.partition("=")[::2] for pair in pairs)
    if any(not name or not path for name, path in named.items()) or len(named) != len(pairs):
        raise ValueError(f"--lora-paths: give distinct NAME=DIR pairs, got {pairs}")
    return named


def _route(args: argparse.Namespace) -> int:
    from verst.auth import ApiKeys
    from verst.router.policy import validate_engine_url
    from verst.router.server import run_router

    engines = [validate_engine_url(url.strip()) for url in args.engines.split(",") if url.strip()]
    if not engines:
        raise ValueError("--engines: give at least one engine URL")
    run_router(
        engines,
        host=args.host,
        port=args.port,
        sessions=args.sessions,
        health_interval_s=args.health_interval_s,
        health_failures=args.health_failures,
        limits=limits_from_args(args),
        api_keys=ApiKeys.resolve(args.api_key, args.admin_api_key),
    )
    return 0


def _sessions(args: argparse.Namespace) -> int:
    from verst.auth import ApiKeys
    from verst.sessions.server import run_session_server

    run_session_server(
        args.router,
        args.model,
        host=args.host,
        port=args.port,
        model_name=args.served_model_name,
        limits=limits_from_args(args),
        ttl_s=args.session_ttl_s,
        max_sessions=args.max_sessions,
        api_keys=ApiKeys.resolve(args.api_key),
        family=args.chat_family,
    )
    return 0
