"""``doccp`` entry point: dispatches to one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Bad
input is reported as one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": ("doccp.app.cli.demo", "run the end-to-end demo: plan, train and decode under CP, check exactness"),
    "plan": ("doccp.app.cli.plan_cmd", "show how a layout is split over CP ranks"),
    "bench": ("doccp.app.cli.bench", "run the benchmarks and regenerate docs/benchmarks.md"),
}


class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="doccp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module, help_text) in COMMANDS.items():
        try:
            modules[name] = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue  # subcommand not built in this version
        p = sub.add_parser(name, help=help_text, description=(modules[name].__doc__ or help_text))
        modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except (UsageError, ValueError, TypeError, OSError) as e:
        print(f"doccp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
