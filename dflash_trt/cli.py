"""`dflash-trt`: a thin command line over the library.

Each subcommand lives in `dflash_trt/commands/<name>.py` with `register(subparsers)` (flags map
1:1 onto configs) and `run(args) -> int`. Typed user errors (DFlashError) print one clear line and
exit 2; anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import logging
import sys

from dflash_trt import __version__
from dflash_trt.errors import DFlashError

COMMANDS = ("generate", "demo", "bench", "serve", "triton", "build", "train", "train-prompts", "train-report", "quantize")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's --help: its description as written, and each option's default, unless the help
    text already says it or there is nothing to say (a flag, an option that is unset by default)."""

    def _format_action(self, action: argparse.Action) -> str:
        if not self._shows_default(action):
            return super()._format_action(action)
        action = copy.copy(action)
        action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"
        return super()._format_action(action)

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        hidden = action.help == argparse.SUPPRESS
        return bool(action.option_strings) and not unset and not hidden and "default" not in (action.help or "").lower()


class CommandParser(argparse.ArgumentParser):
    """The subcommands' parser: HelpFormatter unless a command asks for another."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-trt", description="DFlash speculative decoding: build, serve, benchmark.")
    parser.add_argument("--version", action="version", version=f"dflash-trt {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for name in COMMANDS:
        module = importlib.import_module(f"dflash_trt.commands.{name.replace('-', '_')}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except DFlashError as exc:
        print(f"dflash-trt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflash-trt {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
