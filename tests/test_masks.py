"""Mask: constructors, parsing, and exact pair counting against brute force."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from doccp import Mask
from doccp.masks import UNBOUNDED

SETTINGS = settings(max_examples=150, deadline=None)

masks = st.one_of(
    st.just(Mask.causal()),
    st.just(Mask.full()),
    st.builds(Mask.sliding_window, st.integers(0, 12), st.integers(0, 12)),
    st.builds(Mask, st.none() | st.integers(0, 12), st.none() | st.integers(0, 12)),
)
ranges = st.tuples(st.integers(0, 40), st.integers(0, 40))  # may be empty or reversed


def visible(mask: Mask, i: int, j: int) -> bool:
    return (mask.left is None or j >= i - mask.left) and (mask.right is None or j <= i + mask.right)


def brute_pairs(mask: Mask, q: tuple[int, int], k: tuple[int, int]) -> int:
    return sum(visible(mask, i, j) for i in range(*q) for j in range(*k))


# -- constructors and spelling ---------------------------------------------------------
def test_constructors():
    assert Mask.causal() == Mask(None, 0) and Mask.causal().is_causal and not Mask.causal().is_full
    assert Mask.full() == Mask(None, None) and Mask.full().is_full
    assert Mask.sliding_window(3) == Mask(3, 0)
    assert Mask.sliding_window(3, 2) == Mask(3, 2)
    assert Mask() == Mask.causal()


@pytest.mark.parametrize("text, expected", [
    ("causal", Mask.causal()), (" Full ", Mask.full()), ("window:4", Mask(4, 0)), ("window:4,2", Mask(4, 2)),
    ("WINDOW:0,0", Mask(0, 0)),
])
def test_parse(text, expected):
    assert Mask.parse(text) == expected


@pytest.mark.parametrize("text", ["", "causl", "window:", "window:a", "window:1,2,3", "window:-1", "window:1,-2"])
def test_parse_rejects(text):
    with pytest.raises(ValueError, match="(?i)mask"):
        Mask.parse(text)


@pytest.mark.parametrize("args, error", [
    ((-1, 0), ValueError), ((0, -3), ValueError), ((1.5, 0), TypeError), ((True, 0), TypeError), (("3", 0), TypeError),
])
def test_bad_bounds(args, error):
    with pytest.raises(error, match="Mask"):
        Mask(*args)


def test_views():
    assert Mask.causal().window_size() == (-1, 0)
    assert Mask.full().window_size() == (-1, -1)
    assert Mask(5, 1).window_size() == (5, 1)
    assert (str(Mask.causal()), str(Mask.full()), str(Mask(5, 1)), str(Mask(None, 2))) == (
        "causal", "full", "window(5,1)", "window(inf,2)")
    assert Mask(5, None).left_bound == 5 and Mask(5, None).right_bound == UNBOUNDED


# -- pair counting ---------------------------------------------------------------------
@SETTINGS
@given(masks, ranges, ranges)
def test_pairs_match_brute_force(mask, q, k):
    assert int(mask.pairs(q[0], q[1], k[0], k[1])) == brute_pairs(mask, q, k)


@SETTINGS
@given(masks, st.lists(st.tuples(ranges, ranges), min_size=1, max_size=8))
def test_pairs_vectorised(mask, cases):
    cols = [torch.tensor([c[a][b] for c in cases]) for a in (0, 1) for b in (0, 1)]
    got = mask.pairs(cols[0], cols[1], cols[2], cols[3])
    assert got.tolist() == [brute_pairs(mask, q, k) for q, k in cases]


@SETTINGS
@given(masks, ranges, ranges)
def test_pairs_transpose(mask, q, k):
    """Swapping queries and keys mirrors the band: (left, right) -> (right, left)."""
    mirrored = Mask(mask.right, mask.left)
    assert int(mask.pairs(q[0], q[1], k[0], k[1])) == int(mirrored.pairs(k[0], k[1], q[0], q[1]))


@SETTINGS
@given(masks, st.integers(0, 40), st.data())
def test_visible_keys_and_row_costs(mask, doc_len, data):
    costs = mask.row_costs(doc_len)
    assert costs.tolist() == [sum(visible(mask, i, j) for j in range(doc_len)) for i in range(doc_len)]
    assert int(costs.sum()) == int(mask.pairs(0, doc_len, 0, doc_len))
    if doc_len == 0:
        return
    qs = data.draw(st.integers(0, doc_len - 1))
    qe = data.draw(st.integers(qs + 1, doc_len))
    seen = [j for i in range(qs, qe) for j in range(doc_len) if visible(mask, i, j)]
    lo, hi = mask.visible_keys(qs, qe, doc_len)
    assert (lo, hi) == (min(seen), max(seen) + 1)  # the diagonal is always visible
    tlo, thi = mask.visible_keys(torch.tensor([qs]), torch.tensor([qe]), torch.tensor([doc_len]))
    assert (int(tlo), int(thi)) == (lo, hi)


@pytest.mark.parametrize("length", [2**24, 2**31 + 7, 3 * 10**9])
def test_pairs_exact_for_huge_documents(length):
    """Unbounded sides are a large finite stand-in; counts stay exact whenever they fit int64."""
    n = length
    assert int(Mask.causal().pairs(0, n, 0, n)) == n * (n + 1) // 2
    assert int(Mask.full().pairs(0, n, 0, n)) == n * n
    assert int(Mask.sliding_window(10).pairs(0, n, 0, n)) == 11 * n - 55
    assert int(Mask(None, 5).pairs(0, n, 0, n)) == n * (n + 1) // 2 + 5 * n - 15
