"""The vectorised range helpers against their one-line Python definitions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from doccp.ranges import expand, offsets_within, repeat

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
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=12))
def test_offsets_within_counts_earlier_entries_of_the_same_group(entries):
    group = torch.tensor([g for g, _ in entries], dtype=torch.int64)
    length = torch.tensor([n for _, n in entries], dtype=torch.int64)
    want = [sum(n for g2, n in entries[:i] if g2 == g) for i, (g, _) in enumerate(entries)]
    assert offsets_within(group, length).tolist() == want
