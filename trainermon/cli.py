"""Command line: `trainermon <command>` (also `python -m trainermon <command>`)."""

from __future__ import annotations

import argparse
import logging
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(steps=args.steps, grad_acc=args.grad_acc, output_dir=args.output_dir)
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 2
    print(f"ok: {args.config}: ops={list(cfg.ops)} format={list(cfg.format)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainermon", description="Low-overhead PyTorch training monitor")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT-like model on CPU with monitoring on")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--grad-acc", type=int, default=2)
    demo.add_argument("--output-dir", default=None, help="MONITOR_OUTPUT_DIR (default ./monitor_output)")
    demo.set_defaults(func=_cmd_demo)
    check = sub.add_parser("check-config", help="validate a monitor config file")
    check.add_argument("config")
    check.set_defaults(func=_cmd_check_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args))
