"""The vectorised range helpers against their one-line Python definitions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from doccp.plan.exchange import document_overlaps, overlaps
from doccp.plan.pieces import Pieces
from doccp.ranges import all_true, any_true, batches, expand, offsets_within, repeat, run_entries, spans, stable_order

SETTINGS = settings(max_examples=200, deadline=None)
RUNS = st.lists(st.tuples(st.integers(-100, 100), st.integers(0, 4), st.integers(-3, 3)), max_size=10)


def columns(runs):
    return (torch.tensor([r[i] for r in runs], dtype=torch.int64) for i in range(3))


@SETTINGS
@given(RUNS)
def test_repeat_matches_torch(runs):
    values, counts, _ = columns(runs)
    assert torch.equal(repeat(values, counts), torch.repeat_interleave(values, counts))


@SETTINGS
@given(RUNS)
def test_expand_is_concatenated_ranges(runs):
    first, counts, step = columns(runs)
    want = [a + s * i for a, c, s in runs for i in range(c)]
    assert expand(first, counts, step).tolist() == want
    assert expand(first, counts).tolist() == [a + i for a, c, _ in runs for i in range(c)]


@SETTINGS
@given(RUNS)
def test_run_entries_number_every_run_entry_by_entry(runs):
    first, counts, _ = columns(runs)
    run, value, offsets = run_entries(first, counts)
    assert run.tolist() == [g for g, (_, c, _) in enumerate(runs) for _ in range(c)]
    assert value.tolist() == expand(first, counts).tolist()
    assert offsets.tolist() == [sum(c for _, c, _ in runs[:g]) for g in range(len(runs) + 1)]


@SETTINGS
@given(st.lists(st.integers(0, 9), max_size=20), st.integers(1, 12))
def test_batches_cover_the_groups_in_order_a_few_entries_at_a_time(counts, size):
    """Batches are consecutive whole groups (never split) with their entries, and each ends at
    the last group boundary at or before a multiple of ``size``; spans cut ``[0, total)`` evenly."""
    got = batches(torch.tensor(counts, dtype=torch.int64), size)
    ends = [sum(counts[:g]) for g in range(len(counts) + 1)]
    assert [g for g0, g1, _, _ in got for g in range(g0, g1)] == list(range(len(counts)))
    assert all(g0 < g1 and (e0, e1) == (ends[g0], ends[g1]) for g0, g1, e0, e1 in got)
    for _, g1, _, e1 in got[:-1]:  # a cut: the last boundary at or before some multiple of size
        assert any(e1 <= k * size < ends[g1 + 1] for k in range(1, ends[-1] // size + 1))
    assert [(a, b) for a, b in spans(sum(counts), size)] == [(a, min(a + size, sum(counts)))
                                                             for a in range(0, sum(counts), size)]


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=12))
def test_offsets_within_counts_earlier_entries_of_the_same_group(entries):
    group = torch.tensor([g for g, _ in entries], dtype=torch.int64)
    length = torch.tensor([n for _, n in entries], dtype=torch.int64)
    want = [sum(n for g2, n in entries[:i] if g2 == g) for i, (g, _) in enumerate(entries)]
    assert offsets_within(group, length).tolist() == want


def _table(pieces):
    """Disjoint pieces ``(doc, start, end)`` in stream order from (doc, gap, length) draws."""
    out, cursor = [], {}
    for doc, gap, length in sorted(pieces):
        start = cursor.get(doc, 0) + gap
        out.append((doc, start, start + length))
        cursor[doc] = start + length
    return out


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 4)), max_size=8),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(0, 6)), max_size=8),
       st.tuples(st.integers(0, 8), st.integers(0, 8)))
def test_overlaps_find_every_intersection_in_query_then_table_order(table, queries, skip):
    table = _table(table)
    want = [(i, j, max(lo, a), min(lo + n, b)) for i, (d, lo, n) in enumerate(queries)
            for j, (e, a, b) in enumerate(table) if d == e and max(lo, a) < min(lo + n, b)]
    doc, lo, n = (torch.tensor([q[k] for q in queries], dtype=torch.int64) for k in range(3))
    t = Pieces(*(torch.tensor([x[k] for x in table], dtype=torch.int64) for k in (0, 0, 1, 2)))
    rows = document_overlaps(doc, lo, lo + n, t, num_docs=4)
    assert list(zip(*(c.tolist() for c in rows), strict=True)) == want
    skipped = range(len(queries))[slice(*skip)]  # queries left out get no rows, the rest the same
    rows = document_overlaps(doc, lo, lo + n, t, num_docs=4, skip=slice(*skip))
    assert list(zip(*(c.tolist() for c in rows), strict=True)) == [w for w in want if w[0] not in skipped]
    span = 100  # the same intervals as stream offsets (document d at d * span)
    rows = overlaps(doc * span + lo, doc * span + lo + n, t.doc * span + t.start, t.doc * span + t.end)
    shifted = [(i, j, s + queries[i][0] * span, e + queries[i][0] * span) for i, j, s, e in want]
    assert list(zip(*(c.tolist() for c in rows), strict=True)) == shifted


@SETTINGS
@given(st.lists(st.integers(0, 2**16), max_size=30), st.sampled_from([None, 2**8, 2**15, 2**31]))
def test_stable_order_is_a_stable_argsort_on_any_key_width(keys, bound):
    keys = [k % bound for k in keys] if bound else keys
    want = sorted(range(len(keys)), key=lambda i: keys[i])  # Python's sort is stable
    assert stable_order(torch.tensor(keys, dtype=torch.int64), bound).tolist() == want


@given(st.lists(st.booleans(), max_size=40))
def test_all_true_and_any_true_are_all_and_any(values):
    mask = torch.tensor(values, dtype=torch.bool)
    assert all_true(mask) is all(values) and any_true(mask) is any(values)
