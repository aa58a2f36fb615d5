"""Show how a layout of documents is split over CP ranks: per-rank tokens, work, pieces and
KV to receive, for one strategy or all of them side by side, and optionally a picture.

    doccp plan --lengths 48,56,58,35 --world-size 2
    doccp plan --lengths-file lengths.txt --world-size 8 --mask window:512 --strategy all --plot plan.png
"""

from __future__ import annotations

import argparse
import re
import string
from pathlib import Path

import torch

from doccp.app.cli.main import UsageError
from doccp.app.plot import owners
from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.plan import STRATEGIES, Plan, plan

#: Rank symbols of the text picture (ranks beyond 36 are not drawn).
SYMBOLS = string.digits + string.ascii_lowercase
PICTURE_DOCS, PICTURE_WIDTH = 12, 64
#: Most ranks the command plans for (the per-rank table has one line each).
MAX_WORLD_SIZE = 1 << 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the examples' lines
    p.add_argument("--lengths", metavar="L1,L2,...", help="document lengths in stream order, e.g. 48,56,58,35")
    p.add_argument("--lengths-file", metavar="FILE",
                   help="file of document lengths separated by commas, spaces or newlines ('#' starts a comment)")
    p.add_argument("--world-size", "-n", metavar="N", default="2", help="number of CP ranks (default: 2)")
    p.add_argument("--mask", default="causal",
                   help="causal, full, window:LEFT[,RIGHT] or chunked:SIZE (default: causal)")
    p.add_argument("--strategy", default="balanced",
                   help=f"one of {', '.join(sorted(STRATEGIES))}, or 'all' to compare them (default: balanced)")
    p.add_argument("--plot", metavar="OUT.png",
                   help="write a picture of the mask coloured by rank (with --strategy all: OUT-<strategy>.png)")


def run(args: argparse.Namespace) -> int:
    layout = DocLayout.from_lengths(_lengths(args.lengths, args.lengths_file))
    world_size = _world_size(args.world_size)
    mask = Mask.parse(args.mask)
    strategies = _strategies(args.strategy)
    plans = {name: plan(layout, world_size, mask, name) for name in strategies}

    print(f"doccp plan: {layout.num_docs} documents, {layout.num_tokens} tokens, {world_size} ranks, mask {mask}")
    for name, p in plans.items():
        print(f"\n{name}\n{p.stats().table()}")
        picture = text_picture(p)
        if picture:
            print(picture)
    if len(plans) > 1:
        print(f"\n{comparison(plans)}")
    if args.plot:
        print("\n" + "\n".join(f"wrote {path}" for path in _plot(plans, Path(args.plot))))
    return 0


def comparison(plans: dict[str, Plan]) -> str:
    """One row per strategy: the figures that decide between them."""
    rows = [f"{'strategy':<11} {'imbalance':>9} {'tile imb.':>9} {'pieces':>7} {'max KV in':>10} {'of all-gather':>13}"]
    for name, p in plans.items():
        s = p.stats()
        rows.append(f"{name:<11} {s.imbalance:>9.4f} {s.tile_imbalance:>9.4f} {sum(s.pieces):>7} "
                    f"{max(s.kv_recv):>10} {s.max_kv_fraction:>13.1%}")
    return "\n".join(rows)


def text_picture(p: Plan) -> str:
    """Which rank holds each token of the first documents, one line per document (a
    character per token, or per band of tokens for long documents)."""
    if p.world_size > len(SYMBOLS) or p.layout.num_tokens == 0:
        return ""
    cu, lines = p.layout.cu_seqlens.tolist(), []
    for doc in range(min(p.layout.num_docs, PICTURE_DOCS)):
        start, length = cu[doc], cu[doc + 1] - cu[doc]
        width = min(length, PICTURE_WIDTH)
        sampled = [start + (2 * c + 1) * length // (2 * width) for c in range(width)]
        cells = "".join(SYMBOLS[r] for r in owners(p, torch.tensor(sampled, dtype=torch.int64)).tolist())
        lines.append(f"  doc {doc:<4} {length:>7}  {cells}")
    if p.layout.num_docs > PICTURE_DOCS:
        lines.append(f"  ... {p.layout.num_docs - PICTURE_DOCS} more documents")
    return "token owners (rank per token, sampled for long documents):\n" + "\n".join(lines)


def _lengths(text: str | None, file: str | None) -> list[int]:
    if (text is None) == (file is None):
        raise UsageError("give the document lengths with exactly one of --lengths or --lengths-file")
    source = "--lengths"
    if file is not None:
        source = f"--lengths-file {file}"
        text = "\n".join(line.split("#", 1)[0] for line in Path(file).read_text().splitlines())
    words = [w for w in re.split(r"[\s,\[\]]+", text or "") if w]
    try:
        lengths = [int(w) for w in words]
    except ValueError:
        bad = next(w for w in words if not re.fullmatch(r"[+-]?\d+", w))
        raise UsageError(f"{source}: document lengths must be integers, got {bad!r}") from None
    if not lengths:
        raise UsageError(f"{source}: no document lengths given")
    return lengths


def _world_size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"--world-size must be an integer >= 1, got {text!r}") from None
    if not 1 <= n <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size must be in [1, {MAX_WORLD_SIZE}], got {n}")
    return n


def _strategies(text: str) -> list[str]:
    if text == "all":
        return list(STRATEGIES)
    if text not in STRATEGIES:
        raise UsageError(f"--strategy must be one of {', '.join(sorted(STRATEGIES))} or all, got {text!r}")
    return [text]


def _plot(plans: dict[str, Plan], path: Path) -> list[Path]:
    from doccp.app.plot import plot_plan

    try:
        if len(plans) == 1:
            return [plot_plan(next(iter(plans.values())), path)]
        return [plot_plan(p, path.with_name(f"{path.stem}-{name}{path.suffix or '.png'}")) for name, p in plans.items()]
    except ImportError as e:
        raise UsageError(str(e)) from None
