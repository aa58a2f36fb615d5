"""Seeded document-length mixes: the layouts every benchmark (and the planner tests) use.

A *mix* is a distribution of document lengths; a *layout* is a list of lengths drawn from it
until they add up to exactly ``tokens`` (the last document is cut to fit). The same
``(mix, tokens, index, seed)`` always gives the same layout, on any machine and Python, so
the repository carries its benchmark inputs as code rather than as data files.

==========  ==================================================================================
mix         document lengths
==========  ==================================================================================
pretrain    web-style pretraining: lognormal, median ~1000 tokens, a heavy tail (some documents
            fill the whole pack)
sft         instruction tuning: lognormal, median ~400 tokens, few above 4k
long        long-context continued pretraining: a third of the documents 16k-128k tokens, the
            rest lognormal around 650
lognormal   lognormal with mean ~700, capped at 32k
pareto      Pareto (alpha 1.1) from 64 tokens up, capped at the whole pack: many short
            documents and a few enormous ones
==========  ==================================================================================
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

Draw = Callable[[random.Random, int], float]

MIXES: dict[str, Draw] = {
    "pretrain": lambda rng, _tokens: rng.lognormvariate(6.9, 1.4),
    "sft": lambda rng, _tokens: rng.lognormvariate(6.0, 0.8),
    "long": lambda rng, _tokens: rng.uniform(16384, 131072) if rng.random() < 1 / 3 else rng.lognormvariate(6.5, 1.0),
    "lognormal": lambda rng, _tokens: min(rng.lognormvariate(6.05, 1.0), 32768),
    "pareto": lambda rng, tokens: min(64 * rng.paretovariate(1.1), tokens),
}

#: The three mixes the project has measured since its first version (training-like workloads).
SHARED_MIXES = ("pretrain", "sft", "long")


def layout(mix: str, tokens: int, index: int = 0, seed: int = 0) -> list[int]:
    """Layout ``index`` of ``mix``: document lengths (each >= 1) that sum to exactly ``tokens``."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {sorted(MIXES)}, got {mix!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    draw = MIXES[mix]
    # One stream per (mix, seed, index): adding layouts or mixes never changes existing ones.
    rng = random.Random(f"doccp/{mix}/{seed}/{index}")
    lengths, total = [], 0
    while total < tokens:
        length = max(1, min(math.floor(draw(rng, tokens)), tokens - total))
        lengths.append(length)
        total += length
    return lengths


def layouts(mix: str, tokens: int = 131072, count: int = 16, seed: int = 0) -> list[list[int]]:
    """The first ``count`` layouts of ``mix`` (see :func:`layout`)."""
    return [layout(mix, tokens, i, seed) for i in range(count)]
