"""Bad input: what every command refuses in one paragraph, with exit code 2.

The lowest module of meshyard (it imports nothing of it), so that every package may
raise ``BadInput`` or derive its own input errors from it: ``ConfigError``,
``MissingExtra``, a planner's or a checkpoint tool's errors. ``meshyard.cli.main`` tells
one as ``meshyard: <message>`` on stderr and exits with ``EXIT_BAD_INPUT``; a command
whose own errors read ``meshyard <command>: <message>`` names them when it registers
(``own_errors`` and ``error_prefix`` in ``set_defaults``) and ``call_command`` says them so.
"""

from __future__ import annotations

import argparse
import sys

EXIT_BAD_INPUT = 2
"""Exit code of a command, or a worker, that found its input wrong: restarting cannot help."""


class BadInput(Exception):
    """Input that no retry can fix. Its message is one paragraph that names what is wrong
    and what to give instead; it is shown as it is, without a traceback."""


def call_command(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run the handler a command's ``register`` bound (``args.handler``) and return its exit code.

    The command's own errors (``args.own_errors``) are told here, after its prefix
    (``args.error_prefix``, e.g. ``meshyard plan``), with ``EXIT_BAD_INPUT``; any other
    ``BadInput`` goes on to the caller, which tells it as meshyard's own.
    """
    try:
        return args.handler(args, overrides)
    except getattr(args, "own_errors", ()) as exc:
        print(f"{args.error_prefix}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
