"""The ``raylens`` command line.

Every subcommand is a ``main``-style function; user mistakes (``RaylensError`` and the SDK's
``ValueError`` subclasses) print one line saying what to do and exit 2. ``--debug`` shows the
traceback instead.

This package is the top of ``pipelines``: one module per command group adds its subcommands
(``add_commands``) and runs them, calling into :mod:`pipelines.jobs`, :mod:`pipelines.cluster`,
:mod:`pipelines.serve`, :mod:`pipelines.bench` and :mod:`pipelines.sae_training`. Nothing in
``pipelines`` imports the CLI. A command group's modules are imported when the parser is built,
and each command imports the model side only when it runs, so ``raylens --help`` stays fast.

Run: ``raylens …`` (the console script) or ``python -m pipelines.cli …``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Sequence

__all__ = ["main", "EXIT_USAGE"]

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylens", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from . import (bench_command, generation_commands, internals_commands, ray_commands, sae_eval_command,
                   serve_command, store_commands)

    for group in (generation_commands, bench_command, internals_commands, serve_command, store_commands,
                  ray_commands, sae_eval_command):
        group.add_commands(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from engine.errors import RaylensError
    from mods.loading import ModPayloadError
    from mods.validation import InvalidActionError

    from .arguments import UsageError

    return (UsageError, RaylensError, ModPayloadError, InvalidActionError)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="raylens: %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except _user_errors() as err:
        if args.debug:
            raise
        print(f"raylens: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("raylens: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `raylens query … | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
