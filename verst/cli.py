"""The `verst` command: `verst train`, `verst sft`, `verst eval`, `verst serve`, `verst route`,
`verst sessions`, `verst plot`, `verst dashboard`, `verst model create-tiny`,
`verst model create-tiny-diffusion`, `verst model merge-lora`, `verst serve-diffusion`,
`verst sandbox run`. The servers' commands (serve, route, sessions) are in `verst.server_cli`.

Config errors, missing files, a run directory that cannot be written and non-finite losses end
the command with a one-line message and an exit code of `verst.exitcodes` (2 bad input, 3 the
run directory, 4 a non-finite loss), never a traceback for something the user can fix.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from verst import exitcodes, server_cli
from verst.config import ConfigError, help_text, load_config
from verst.diffusion import cli as diffusion_cli
from verst.envs.sandbox import cli as sandbox_cli
from verst.fleet.ray_cluster import PLACEMENT_GROUP_ENV
from verst.models.families import FAMILIES
from verst.rundir import RunDirError, check_writable, holds_run, run_dir_error, writing

TRAIN_EPILOG = """overrides: section.field=value, e.g. trainer.lr=1e-5 rollout.temperature=0.8

config fields (YAML keys / overrides):
"""


def _train_parser(subparsers: argparse._SubParsersAction, command: str = "train") -> None:
    sft = command == "sft"
    parser = subparsers.add_parser(
        command,
        help="run supervised fine-tuning from a YAML config (mode=sft)"
        if sft
        else "run RL training (or, with mode=sft, SFT) from a YAML config",
        description="Run supervised fine-tuning on the sft section's data: `verst train` with "
        "mode=sft."
        if sft
        else "Run the RL loop: rollout → reward → train → weight sync (mode=sft: supervised "
        "fine-tuning instead).",
        epilog=TRAIN_EPILOG + help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", nargs="?", help="YAML config file (omit to use defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides: section.field=value")
    parser.add_argument(
        "--run-dir", type=Path, help="output directory (default runs/<config name>)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument(
        "--overwrite", action="store_true", help="delete an existing run directory first"
    )
    parser.add_argument(
        "--max-restarts",
        type=_non_negative,
        default=0,
        metavar="N",
        help="run the trainer as a child process and restart it from its last checkpoint when "
        "it crashes, at most N times (default 0: no child, no restarts)",
    )


def _eval_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="score a saved checkpoint on a config's evaluation sets and print a table",
        description="Score an HF model directory (a checkpoint of verst train) on the config's "
        "evaluation sets (eval.sets, or eval.data) with the embedded engine; with model.kind="
        "diffusion, a diffusion checkpoint on every caption (diffusion.eval_*, its reward).",
    )
    parser.add_argument("checkpoint", type=Path, help="model directory, e.g. a checkpoint")
    parser.add_argument("config", help="YAML config file whose eval section to use")
    parser.add_argument("overrides", nargs="*", help="dotted overrides: section.field=value")


def _eval(args: argparse.Namespace) -> int:
    from verst.eval.offline import evaluate_checkpoint_dir, format_table

    cfg = load_config(args.config, args.overrides)
    if cfg.model.kind == "diffusion":
        from verst.diffusion.evaluation import evaluate_checkpoint_dir, format_table
    print(format_table(evaluate_checkpoint_dir(args.checkpoint, cfg)))
    return 0


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _model_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="model utilities")
    commands = parser.add_subparsers(dest="model_command", required=True)
    tiny = commands.add_parser(
        "create-tiny", help="write a tiny random-weight HF model and tokenizer to DIR"
    )
    tiny.add_argument("dir", type=Path)
    tiny.add_argument(
        "--family",
        choices=FAMILIES,
        default="qwen3",
        help="architecture of the tiny model (default: %(default)s)",
    )
    tiny.add_argument("--hidden-size", type=int, default=128)
    tiny.add_argument("--num-layers", type=int, default=4)
    tiny.add_argument("--seed", type=int, default=0)
    diffusion = commands.add_parser(
        "create-tiny-diffusion",
        help="write a tiny class-conditioned rectified-flow DiT (diffusers), briefly pre-trained "
        "on procedural coloured shapes, to DIR",
    )
    diffusion.add_argument("dir", type=Path)
    diffusion.add_argument("--image-size", type=int, default=16, help="pixels per side")
    diffusion.add_argument("--hidden-size", type=int, default=64)
    diffusion.add_argument("--num-layers", type=int, default=3)
    diffusion.add_argument(
        "--pretrain-steps",
        type=_non_negative,
        default=400,
        help="flow-matching steps on the shapes (0 = random weights; default: %(default)s)",
    )
    diffusion.add_argument("--seed", type=int, default=0)
    merge = commands.add_parser(
        "merge-lora", help="merge a LoRA adapter (peft format) into BASE and write the model OUT"
    )
    merge.add_argument("base", type=Path, help="HF or diffusion model directory it trained on")
    merge.add_argument("adapter", type=Path, help="adapter directory, e.g. a LoRA checkpoint")
    merge.add_argument("out", type=Path, help="directory to write the merged model to")


def _plot_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="draw the main curves of runs into a PNG",
        description="Draw reward, held-out accuracy, response length, log-prob diff / KL, "
        "gradient norm and the phase breakdown of one run, or of several overlaid, from their "
        "metrics.jsonl into one PNG; what cannot be drawn is listed on stderr.",
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the PNG to write")


def _dashboard_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dashboard",
        help="serve a live web page of runs (pip install -e '.[serve]')",
        description="Serve a web page that follows run directories as they are written: "
        "reward, held-out accuracy, response length, log-prob diff / KL, gradient norm, the "
        "stacked phase breakdown, engine throughput and cache hit, buffer size and staleness, "
        "the advisor's advice and a viewer of each step's samples; several runs side by side.",
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8265, help="port; 0 = any free port")


def _split_config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """argparse cannot tell `CONFIG` from a first override; an `=` decides."""
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        overrides.insert(0, config)
        config = None
    return config, overrides


def _prepare_run_dir(args: argparse.Namespace, config: str | None) -> Path:
    run_dir = args.run_dir or Path("runs") / (Path(config).stem if config else "default")
    has_run = holds_run(run_dir)
    if args.resume and not has_run:
        raise ConfigError(f"--resume: {run_dir} holds no run to resume")
    if has_run and not args.resume:
        if not args.overwrite:
            raise ConfigError(
                f"{run_dir} already holds a run; pass --resume to continue it, --overwrite to "
                "start over, or --run-dir for a new directory"
            )
        with writing(run_dir):
            shutil.rmtree(run_dir)
    return run_dir


def _check_restarts(args: argparse.Namespace) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.max_restarts and world_size > 1:
        raise ConfigError(
            f"--max-restarts: this process is one of {world_size} ranks under torchrun, which "
            "restarts its ranks itself: pass --max-restarts to torchrun instead"
        )


def _train(args: argparse.Namespace) -> int:
    _check_restarts(args)
    config, overrides = _split_config_and_overrides(args)
    if args.command == "sft":
        overrides.insert(0, "mode=sft")
    cfg = load_config(config, overrides)
    run_dir = _prepare_run_dir(args, config)
    check_writable(run_dir)
    train_args = [*([config] if config else []), *overrides, "--run-dir", str(run_dir)]
    if cfg.placement.backend == "ray" and PLACEMENT_GROUP_ENV not in os.environ:
        from verst.ray_train import train_on_ray

        return train_on_ray(
            cfg.placement, train_args, run_dir, args.max_restarts, resume=args.resume
        )
    if args.max_restarts:
        from verst.supervisor import Supervisor

        return Supervisor(train_args, run_dir, args.max_restarts).run(resume=args.resume)
    # heavy imports only once the config is known to be valid
    if cfg.model.kind == "diffusion":
        from verst.diffusion.loop import train
    elif cfg.mode == "sft":
        from verst.sft_loop import run_sft as train
    else:
        from verst.loop import train

    try:
        train(cfg, run_dir, resume=args.resume)
    except Exception as error:
        disk_error = run_dir_error(error, run_dir)
        if disk_error is None:
            raise
        raise disk_error from error
    return 0


def _create_tiny(args: argparse.Namespace) -> int:
    from verst.models.tiny import TinyModelConfig, create_tiny

    cfg = TinyModelConfig(
        family=args.family, hidden_size=args.hidden_size, num_layers=args.num_layers
    )
    create_tiny(args.dir, cfg, seed=args.seed)
    print(f"wrote a tiny {args.family} model and tokenizer to {args.dir}")
    return 0


def _create_tiny_diffusion(args: argparse.Namespace) -> int:
    from verst.diffusion.model import TinyDiffusionSpec, create_tiny_diffusion

    spec = TinyDiffusionSpec(
        image_size=args.image_size, hidden_size=args.hidden_size, num_layers=args.num_layers
    )
    loss = create_tiny_diffusion(args.dir, spec, pretrain_steps=args.pretrain_steps, seed=args.seed)
    print(f"wrote a tiny diffusion model to {args.dir} (last pre-training loss {loss:.4f})")
    return 0


def _merge_lora(args: argparse.Namespace) -> int:
    from verst.diffusion.adapters import merge_lora  # an LM's BASE goes to verst.models.lora

    merge_lora(args.base, args.adapter, args.out)
    print(f"wrote {args.base} with the adapter of {args.adapter} merged to {args.out}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from verst.monitor.plot import plot_runs

    plot = plot_runs(args.run_dirs, args.output)
    for line in plot.skipped:
        print(f"verst plot: skipped {line}", file=sys.stderr)
    print(f"wrote {plot.path} ({len(plot.runs)} run{'s' * (len(plot.runs) != 1)})")
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from verst.monitor.dashboard.server import serve

    missing = [str(d) for d in args.run_dirs if not d.is_dir()]
    if missing:
        print(
            f"verst dashboard: {', '.join(missing)}: no such run directory yet; polling it",
            file=sys.stderr,
        )
    serve(
        args.run_dirs, host=args.host, port=args.port, announce=lambda line: print(line, flush=True)
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verst", description="RL post-training for LLMs")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _train_parser(subparsers)
    _train_parser(subparsers, "sft")
    _eval_parser(subparsers)
    server_cli.add_parsers(subparsers)
    _plot_parser(subparsers)
    _dashboard_parser(subparsers)
    diffusion_cli.add_parser(subparsers)
    _model_parser(subparsers)
    sandbox_cli.add_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        if args.command in ("train", "sft"):
            return _train(args)
        if args.command == "eval":
            return _eval(args)
        if args.command in server_cli.COMMANDS:
            return server_cli.run_command(args)
        if args.command == "sandbox":
            return sandbox_cli.run_command(args)
        if args.command == "plot":
            return _plot(args)
        if args.command == "dashboard":
            return _dashboard(args)
        if args.command == "serve-diffusion":
            return diffusion_cli.run_command(args)
        if args.model_command == "merge-lora":
            return _merge_lora(args)
        if args.model_command == "create-tiny-diffusion":
            return _create_tiny_diffusion(args)
        return _create_tiny(args)
    except RunDirError as error:
        print(f"verst: error: {error}", file=sys.stderr)
        return exitcodes.RUN_DIR
    except (ConfigError, FileNotFoundError, ImportError, ValueError) as error:
        print(f"verst: error: {error}", file=sys.stderr)
        return exitcodes.BAD_INPUT
    except Exception as error:
        from verst.fleet.health import EngineRestartError
        from verst.router.policy import NoEngineAvailable
        from verst.sync.protocol import WeightSyncError
        from verst.train.trainer import NonFiniteLossError

        if isinstance(error, NonFiniteLossError):
            print(f"verst: run stopped: {error}", file=sys.stderr)
            return exitcodes.NON_FINITE
        if isinstance(error, WeightSyncError | EngineRestartError | NoEngineAvailable):
            # the engines failed beyond repair: a restart of the whole run may still succeed
            print(f"verst: run stopped: {error}", file=sys.stderr)
            return exitcodes.CRASH
        raise


if __name__ == "__main__":
    sys.exit(main())
