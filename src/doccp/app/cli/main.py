"""doccp: exact, balanced context-parallel attention over packed variable-length documents.

Commands: `doccp demo` (the tour: plan, train and generate under CP, checked against one
process), `doccp plan` (how a layout splits over ranks, with pictures) and `doccp bench` (the
benchmarks, from a source checkout). `doccp COMMAND --help` describes each.
"""

# Each command is a module with ``add_arguments(parser)`` and ``run(args) -> int``; bad input
# is one line on stderr and exit code 2.

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": ("doccp.app.cli.demo", "run the end-to-end demo: plan, train and decode under CP, check exactness"),
    "plan": ("doccp.app.cli.plan_cmd", "show how a layout is split over CP ranks"),
    "bench": ("doccp.app.cli.bench", "run the benchmarks (from a source checkout) and assemble their page"),
}


class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="doccp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules, parsers = {}, {}
    for name, (module, help_text) in COMMANDS.items():
        try:
            modules[name] = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue  # subcommand not built in this version
        parsers[name] = sub.add_parser(name, help=help_text, description=(modules[name].__doc__ or help_text))
        modules[name].add_arguments(parsers[name])
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if extra:  # reported with the command's usage, not the top-level one
        parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(modules[args.command].run(args) or 0)
    except (UsageError, ValueError, TypeError, OSError) as e:
        print(f"doccp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
