"""`verst serve-diffusion`: the diffusion engine over HTTP (`verst.diffusion.server`)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve-diffusion",
        help="serve a diffusion model directory: POST /rollout/generate records trajectories",
    )
    parser.add_argument("--model", required=True, help="a create-tiny-diffusion directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30010)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def run_command(args: argparse.Namespace) -> int:
    import torch

    from verst.diffusion.server import run_diffusion_server

    if args.device.startswith("cuda:"):  # a broadcast group's NCCL ranks use the current GPU
        torch.cuda.set_device(torch.device(args.device))
    run_diffusion_server(args.model, host=args.host, port=args.port, device=args.device)
    return 0
