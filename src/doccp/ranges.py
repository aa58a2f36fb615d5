"""Vectorised range arithmetic on int64 tensors: the few idioms every host-side table uses.

Plans, schedules, slices and caches are tables of runs ``(first, count)``; turning them into
per-token indices, or numbering entries within their group, are the same three loops-free
operations everywhere. They run serially on small inputs (``torch.repeat_interleave``
parallelises with grain size 1 on CPU, which wakes the intra-op thread pool on every call:
milliseconds per call on a busy host, and a plan makes dozens of calls).

Host tables gather with :func:`take` (``index_select``), not ``column[index]``: on CPU, advanced
indexing with an int64 tensor is 4-5x slower than ``index_select`` (and ``index_copy_`` 3x slower
than ``scatter_``), and schedules gather millions of entries per batch at scale.
"""

from __future__ import annotations

import torch


def starts(counts: torch.Tensor) -> torch.Tensor:
    """Where each run starts when runs of ``counts`` lie back to back (exclusive cumsum), in one
    buffer (``cumsum(counts) - counts`` writes a second one)."""
    return torch.cumsum(counts, 0).sub_(counts)


def repeat(values: torch.Tensor, counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times (``torch.repeat_interleave``, serial): the first
    element of each run carries the step from the previous value and one cumsum fills the runs."""
    total = int(counts.sum()) if total is None else total
    steps = torch.zeros(total + 1, dtype=torch.int64)
    steps.index_add_(0, starts(counts), _steps(values, 0))
    return steps[:total].cumsum_(0)


def expand(first: torch.Tensor, counts: torch.Tensor, step: torch.Tensor | None = None) -> torch.Tensor:
    """``cat([first[i] + step[i] * arange(counts[i]) for i])``; ``step`` defaults to 1, where one
    cumsum over one buffer does it (steps of 1, and a jump where a run starts)."""
    total = int(counts.sum())
    offsets = starts(counts)
    if step is None:
        jumps = _steps(first - offsets, 1)
        steps = torch.ones(total + 1, dtype=torch.int64).index_add_(0, offsets, jumps)
        return steps[:total].cumsum_(0)
    index = repeat(torch.arange(first.numel()), counts, total)
    return take(first, index) + take(step, index) * (torch.arange(total) - take(offsets, index))


def run_entries(first: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runs ``first[g], first[g] + 1, ..., first[g] + counts[g] - 1`` entry by entry: each
    entry's run ``g`` and value, and where each run's entries start (``len(counts) + 1`` offsets).
    :func:`expand` when the run of each entry is wanted too (one :func:`repeat`, and the values
    from it by gathers: no second pass over the runs)."""
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    run = repeat(torch.arange(counts.numel()), counts, int(offsets[-1]))
    return run, torch.arange(run.numel()).sub_(take(offsets, run)).add_(take(first, run)), offsets


def _steps(x: torch.Tensor, before: int) -> torch.Tensor:
    """``x[i] - x[i - 1]``, reading ``x[-1]`` as ``before``: ``torch.diff`` with ``prepend``, which
    is several times slower on host tables (it copies its input into a new buffer first)."""
    out = torch.empty_like(x)
    if x.numel():
        torch.sub(x[1:], x[:-1], out=out[1:])
        out[:1] = x[:1] - before
    return out


def stable_order(keys: torch.Tensor, bound: int | None = None) -> torch.Tensor:
    """``torch.argsort(keys, stable=True)`` for non-negative integer keys below ``bound`` (default:
    their max + 1), sorted as the narrowest integer type that holds them: CPU sort time grows
    with the key's width (rank and step keys as uint8 or int16 sort 2-4x faster than as int32)."""
    if bound is None:
        bound = int(keys.max()) + 1 if keys.numel() else 0
    dtype = next(t for limit, t in _SORT_TYPES if bound <= limit)
    return torch.argsort(keys.to(dtype), stable=True)


#: Entries a host pipeline takes at a time (:func:`batches`): a chain of gathers and elementwise ops
#: over 2^18 int64 entries stays in cache and reuses the heap, where whole 10^7-entry tables
#: page-fault every fresh buffer: 2x faster per entry at 16M tokens over 1024 ranks.
BATCH = 1 << 18

_SORT_TYPES = ((2**8, torch.uint8), (2**15, torch.int16), (2**31, torch.int32), (2**63, torch.int64))


def offsets_within(group: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """For each entry, the total ``length`` of the earlier entries (in the given order) of the
    same ``group`` (non-negative ids): where it starts in its group's buffer when every group is
    packed in order. One stable sort by group and one cumsum: an entry's offset in the groups laid
    out back to back, less where its group starts there (from the groups' totals)."""
    if group.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    bound = int(group.max()) + 1
    order = stable_order(group, bound)
    before = starts(take(length, order))
    first = starts(torch.zeros(bound, dtype=torch.int64).index_add_(0, group, length))
    return torch.empty_like(before).scatter_(0, order, before).sub_(take(first, group))


def spans(total: int, size: int | None = None) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of about :data:`BATCH` (or ``size``) entries covering ``[0, total)``:
    a host pipeline over a big table, taken a span at a time, keeps its temporaries in cache."""
    size = size or BATCH
    return [(a, min(a + size, total)) for a in range(0, total, size)]


def batches(counts: torch.Tensor, size: int | None = None) -> list[tuple[int, int, int, int]]:
    """Consecutive groups (e.g. documents, ``counts[g]`` entries each) in batches of about
    ``size`` entries: ``(g0, g1, e0, e1)``, groups ``[g0, g1)`` and their entries ``[e0, e1)``
    laid out back to back. A batch ends at the last group boundary at or before a multiple of
    ``size`` entries (groups are never split, so a big group makes a big batch)."""
    size = size or BATCH
    ends = torch.cumsum(counts, 0)
    total = int(ends[-1]) if counts.numel() else 0
    cuts = torch.searchsorted(ends, torch.arange(size, total, size), right=True).tolist() if total > size else []
    groups = [0, *sorted(set(cuts) - {0, counts.numel()}), counts.numel()] if counts.numel() else []
    entries = [0, *take(ends, torch.tensor(groups[1:], dtype=torch.int64) - 1).tolist()] if groups else []
    return list(zip(groups, groups[1:], entries, entries[1:], strict=False))


def all_true(mask: torch.Tensor) -> bool:
    """``bool(mask.all())`` for a bool tensor, by counting: on CPU, ``Tensor.all`` on a host
    table of 10^5 entries takes ~3x as long as ``torch.count_nonzero`` (and ``(x >= 0).all()``
    ~10x as long as ``x.min() >= 0``: prefer a reduction of the values to a test of a mask)."""
    return int(torch.count_nonzero(mask)) == mask.numel()


def any_true(mask: torch.Tensor) -> bool:
    """``bool(mask.any())`` for a bool tensor, by counting (see :func:`all_true`)."""
    return int(torch.count_nonzero(mask)) > 0


def index_of(keep):
    """``keep`` ready to take rows from several columns: ``None`` for an all-true bool mask (take
    nothing, keep everything), the indices of a bool mask (found once, not once per column), or
    ``keep`` itself (indices or a slice)."""
    if isinstance(keep, torch.Tensor) and keep.dtype == torch.bool:
        return None if all_true(keep) else torch.nonzero(keep).squeeze(1)
    return keep


def take(column: torch.Tensor, index) -> torch.Tensor:
    """``column[index]`` for an :func:`index_of` result (``None``: the column itself)."""
    if index is None:
        return column
    return column.index_select(0, index) if isinstance(index, torch.Tensor) else column[index]
