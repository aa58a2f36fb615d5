"""Mask: constructors, parsing, and exact pair counting against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import visible as oracle_visible

from doccp import Mask
from doccp.kernels.slices import Slices
from doccp.masks import UNBOUNDED, BandMask, ChunkedMask

SETTINGS = settings(max_examples=150, deadline=None)

bands = st.one_of(
    st.just(Mask.causal()),
    st.just(Mask.full()),
    st.builds(Mask.sliding_window, st.integers(0, 12), st.integers(0, 12)),
    st.builds(Mask, st.none() | st.integers(0, 12), st.none() | st.integers(0, 12)),
)
masks = bands | st.builds(Mask.chunked, st.integers(1, 9))
ranges = st.tuples(st.integers(0, 40), st.integers(0, 40))  # may be empty or reversed


def visible(mask: Mask, i: int, j: int) -> bool:
    return bool(oracle_visible(mask, torch.tensor(i), torch.tensor(j)))


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
@given(bands, ranges, ranges)
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


@SETTINGS
@given(masks, st.lists(st.tuples(st.integers(-1, 30), st.integers(0, 31), st.integers(1, 31)), min_size=1, max_size=6))
def test_visible_ranges_are_elementwise_over_any_mix_of_ints_and_tensors(mask, rows):
    """The hull functions take ints or int64 tensors in any mix (schedules pass a piece's
    ``start - 1``, a scalar length, a column of lengths), the unbounded sides' shortcuts included."""
    for fn in (mask.visible_keys, mask.visible_queries):
        for mix in itertools.product((False, True), repeat=3):
            if not any(mix):
                continue
            # an int argument is the first row's value, for every row
            fixed = [[r[k] if mix[k] else rows[0][k] for k in range(3)] for r in rows]
            want = [tuple(int(v) for v in fn(*r)) for r in fixed]
            args = [torch.tensor([r[k] for r in fixed], dtype=torch.int64) if mix[k] else rows[0][k] for k in range(3)]
            # a tensor, or an int where only int arguments decide it
            lo, hi = (torch.as_tensor(v).expand(len(rows)) for v in fn(*args))
            assert list(zip(lo.tolist(), hi.tolist(), strict=True)) == want


@pytest.mark.parametrize("length", [2**24, 2**31 + 7, 3 * 10**9])
def test_pairs_exact_for_huge_documents(length):
    """Unbounded sides are a large finite stand-in; counts stay exact whenever they fit int64."""
    n = length
    assert int(Mask.causal().pairs(0, n, 0, n)) == n * (n + 1) // 2
    assert int(Mask.full().pairs(0, n, 0, n)) == n * n
    assert int(Mask.sliding_window(10).pairs(0, n, 0, n)) == 11 * n - 55
    assert int(Mask(None, 5).pairs(0, n, 0, n)) == n * (n + 1) // 2 + 5 * n - 15
    for mask in (Mask.causal(), Mask.full(), Mask.sliding_window(10)):
        assert int(mask.row_work(0, n, n)) == int(mask.pairs(0, n, 0, n))
        assert int(mask.row_work(n - 7, n, n)) == int(mask.pairs(n - 7, n, 0, n))


@SETTINGS
@given(masks, st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=8))
def test_row_work_is_the_pairs_of_rows_with_their_whole_document(mask, rows):
    """The planners' shortcut (causal: triangle numbers, full: a rectangle) against the general
    pair count, on any rows within their document (empty and reversed ranges count 0)."""
    rows = [(min(a, n), min(b, n), n) for a, b, n in rows]
    q0, q1, n = (torch.tensor(c, dtype=torch.int64) for c in zip(*rows, strict=True))
    assert mask.row_work(q0, q1, n).tolist() == mask.pairs(q0, q1, 0, n).tolist()
    assert [int(mask.row_work(a, b, c)) for a, b, c in rows] == mask.pairs(q0, q1, 0, n).tolist()


# -- the protocol, for every kind of mask ------------------------------------------------
def test_chunked_constructors_and_spelling():
    assert Mask.chunked(4) == ChunkedMask(4) and str(Mask.chunked(4)) == "chunked(4)"
    assert Mask.parse("chunked:8") == Mask.chunked(8) and Mask.parse(" Chunked:1 ") == Mask.chunked(1)
    assert Mask.chunked(2**40) == Mask.causal()  # a chunk longer than any document
    assert not Mask.chunked(3).looks_ahead and not Mask.causal().looks_ahead and Mask(2, 1).looks_ahead
    for mask in (Mask.causal(), Mask.full(), Mask(3, None), Mask(0, 2), Mask.chunked(5)):
        assert Mask.from_spec(mask.spec()) == mask
    for text in ("chunked:", "chunked:0", "chunked:x", "chunked:2,3"):
        with pytest.raises(ValueError, match="(?i)mask|size"):
            Mask.parse(text)
    with pytest.raises(TypeError, match="ChunkedMask.size"):
        Mask.chunked(2.5)
    assert isinstance(Mask(3, 0), BandMask) and isinstance(Mask.chunked(3), Mask)


@SETTINGS
@given(masks, st.integers(1, 30))
def test_every_row_sees_one_interval_whose_ends_never_decrease(mask, doc_len):
    """The monotone-interval property every consumer of the protocol relies on."""
    ends = []
    for i in range(doc_len):
        seen = [j for j in range(doc_len) if visible(mask, i, j)]
        assert seen == list(range(seen[0], seen[-1] + 1)), (mask, i)  # one interval, diagonal included
        ends.append((seen[0], seen[-1]))
    assert ends == sorted(ends) and [e[1] for e in ends] == sorted(e[1] for e in ends)


@SETTINGS
@given(masks, st.integers(1, 30), st.data())
def test_visible_queries_are_the_hull_of_the_queries_that_see_a_key_range(mask, doc_len, data):
    ks = data.draw(st.integers(0, doc_len - 1))
    ke = data.draw(st.integers(ks + 1, doc_len))
    seeing = [i for i in range(doc_len) if any(visible(mask, i, j) for j in range(ks, ke))]
    assert mask.visible_queries(ks, ke, doc_len) == (min(seeing), max(seeing) + 1)


@SETTINGS
@given(masks, st.lists(st.tuples(st.integers(0, 20), st.integers(0, 9), st.integers(0, 20), st.integers(0, 9)),
                       min_size=1, max_size=6))
def test_bands_cover_exactly_the_pairs_of_the_slices(mask, rows):
    """Rewritten as band-masked parts, a set of slices covers the same (row, key row) pairs."""
    q_row, k_row = 0, 0
    cols = []
    for q_pos, m, k_pos, n in rows:
        cols.append((q_row, q_row + m, k_row, k_row + n, q_pos, k_pos))
        q_row, k_row = q_row + m, k_row + n
    slices = Slices.of(*zip(*cols, strict=True))

    def pairs_of(s: Slices, m: Mask) -> set:
        return {(s.q_start[x].item() + a, s.k_start[x].item() + b)
                for x in range(len(s)) for a in range(int(s.q_end[x] - s.q_start[x]))
                for b in range(int(s.k_end[x] - s.k_start[x]))
                if visible(m, int(s.q_pos0[x]) + a, int(s.k_pos0[x]) + b)}

    got = [pairs_of(s, band) for s, band in mask.bands(slices)]
    assert all(isinstance(band, BandMask) for _, band in mask.bands(slices))
    assert sum(len(g) for g in got) == len(set().union(*got))  # parts never share a pair
    assert set().union(*got) == pairs_of(slices, mask)
