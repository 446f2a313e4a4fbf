"""`verst sandbox run`: one command in a fresh sandbox, for people debugging an environment.

    verst sandbox run [--provider NAME] [--timeout S] [--set FIELD=VALUE ...] -- CMD ARGS...

Prints the command's stdout and stderr as they were, then one status line on stderr, and exits
with the command's exit code (124 on a timeout, as coreutils' `timeout` does).
"""

from __future__ import annotations

import argparse
import sys

import yaml
from pydantic import ValidationError

from verst.envs.sandbox import SandboxConfig, SandboxError, make_sandbox
from verst.envs.sandbox.base import RunResult

TIMEOUT_EXIT = 124


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sandbox", help="run commands in an environment sandbox")
    commands = parser.add_subparsers(dest="sandbox_command", required=True)
    run = commands.add_parser(
        "run",
        help="run one command in a fresh sandbox and print its output and exit status",
        description="Runs CMD in a fresh sandbox (a new, empty work directory that is deleted "
        "afterwards) under the env.sandbox limits, prints its output, and exits with its code.",
    )
    run.add_argument(
        "--provider", choices=["bubblewrap", "process", "docker"], default="bubblewrap"
    )
    run.add_argument("--timeout", type=float, help="wall clock in seconds (env.sandbox.timeout_s)")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any env.sandbox field, e.g. --set memory_bytes=268435456 --set max_processes=8",
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")


def _config(args: argparse.Namespace) -> SandboxConfig:
    fields: dict[str, object] = {"provider": args.provider}
    if args.timeout is not None:
        fields["timeout_s"] = args.timeout
    for item in args.set:
        name, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r} is not of the form FIELD=VALUE")
        fields[name.strip()] = yaml.safe_load(raw)
    try:
        return SandboxConfig(**fields)
    except ValidationError as error:
        problems = "; ".join(
            f"env.sandbox.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()
        )
        raise ValueError(problems) from None


def status_line(result: RunResult, provider: str) -> str:
    if result.timed_out:
        what = f"timed out after {result.duration_s:.1f} s, everything it started was killed"
    elif result.killed_reason:
        what = f"killed ({result.killed_reason}), exit {result.exit_code}"
    else:
        what = f"exit {result.exit_code}"
    cut = ", output cut at max_output_bytes" if result.output_truncated else ""
    return f"verst sandbox ({provider}, {result.duration_s:.2f} s): {what}{cut}"


def run_command(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("verst sandbox run: give a command after --")
    cfg = _config(args)
    try:
        with make_sandbox(cfg) as box:
            result = box.run_sync(cmd)
    except SandboxError as error:
        raise ValueError(str(error)) from None
    sys.stdout.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.write(result.stderr)
    print(status_line(result, cfg.provider), file=sys.stderr)
    return TIMEOUT_EXIT if result.timed_out else min(result.exit_code, 255)
