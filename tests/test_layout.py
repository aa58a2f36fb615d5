"""DocLayout: every input format, the per-token maps, and clear errors on bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from doccp import DocLayout

SETTINGS = settings(max_examples=100, deadline=None)

lengths_lists = st.lists(st.integers(0, 20), max_size=12)


def slow_maps(lengths: list[int]) -> tuple[list[int], list[int]]:
    """Document id and document-relative position of every token, one token at a time."""
    doc_ids, positions = [], []
    for d, length in enumerate(lengths):
        for i in range(length):
            doc_ids.append(d)
            positions.append(i)
    return doc_ids, positions


# -- the packed stream -------------------------------------------------------------------
@SETTINGS
@given(lengths_lists)
def test_from_lengths(lengths):
    layout = DocLayout.from_lengths(lengths)
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    assert layout.cu_seqlens.tolist() == cu and layout.cu_seqlens.dtype == torch.int64
    assert layout.lengths.tolist() == lengths
    assert (layout.num_docs, layout.num_tokens, layout.max_len) == (len(lengths), sum(lengths), max(lengths, default=0))
    doc_ids, positions = slow_maps(lengths)
    assert layout.doc_ids().tolist() == doc_ids
    assert layout.positions().tolist() == positions
    assert DocLayout.from_cu_seqlens(cu) == layout
    assert DocLayout.from_cu_seqlens(torch.tensor(cu, dtype=torch.int32)) == layout
    assert hash(DocLayout.from_lengths(torch.tensor(lengths, dtype=torch.int64))) == hash(layout)


@SETTINGS
@given(st.lists(st.integers(1, 20), max_size=12), st.integers(0, 3))
def test_from_position_ids(lengths, start):
    """Documents start where positions do not continue (transformers' packed-sequence rule), from
    any start value; zero-length documents cannot be expressed, so none are generated."""
    layout = DocLayout.from_lengths(lengths)
    positions = layout.positions() + start
    assert DocLayout.from_position_ids(positions) == layout
    assert DocLayout.from_position_ids(positions.unsqueeze(0)) == layout
    assert DocLayout.from_position_ids([positions.tolist()]) == layout
    assert DocLayout.from_position_ids(positions.tolist()) == layout


def test_input_types_and_repr():
    assert DocLayout.from_lengths(np.array([3, 0, 2])).lengths.tolist() == [3, 0, 2]
    assert DocLayout.from_lengths([np.int64(3), 2]).lengths.tolist() == [3, 2]
    assert DocLayout.from_lengths(torch.tensor([1, 2], dtype=torch.uint8)).num_tokens == 3
    assert DocLayout.from_lengths(range(4)).lengths.tolist() == [0, 1, 2, 3]
    assert "num_docs=10" in repr(DocLayout.from_lengths([1] * 10)) and "..." in repr(DocLayout.from_lengths([1] * 10))
    assert DocLayout.from_lengths([1, 2]) != DocLayout.from_lengths([2, 1])
    assert DocLayout.from_lengths([1, 2]) != [1, 2]


def test_cu_seqlens_is_copied():
    cu = torch.tensor([0, 2, 5])
    layout = DocLayout.from_cu_seqlens(cu)
    cu[1] = 9
    assert layout.lengths.tolist() == [2, 3]


def test_empty_and_zero_length_documents():
    empty = DocLayout.from_lengths([])
    assert (empty.num_docs, empty.num_tokens, empty.max_len) == (0, 0, 0)
    assert empty.doc_ids().numel() == 0 and empty.positions().numel() == 0
    zeros = DocLayout.from_cu_seqlens([0, 0, 0, 3, 3])
    assert zeros.lengths.tolist() == [0, 0, 3, 0]
    assert zeros.doc_ids().tolist() == [2, 2, 2]


# -- padded batches ----------------------------------------------------------------------
@SETTINGS
@given(st.integers(0, 9).flatmap(lambda max_len: st.tuples(
    st.just(max_len), st.lists(st.integers(0, max_len), max_size=5))))
def test_padded_round_trip(case):
    max_len, doc_lens = case
    layout = DocLayout.from_padded(doc_lens, max_len)
    assert layout.lengths.tolist() == doc_lens and layout.rows == (len(doc_lens), max_len)
    x = torch.randn(len(doc_lens), max_len, 3)
    packed = layout.pack_padded(x)
    expected = [x[b, i] for b, length in enumerate(doc_lens) for i in range(length)]
    assert torch.equal(packed, torch.stack(expected) if expected else x.new_zeros(0, 3))
    assert layout.padded_index().tolist() == [b * max_len + i for b, length in enumerate(doc_lens)
                                              for i in range(length)]
    back = layout.unpack_padded(packed, fill=-1.0)
    valid = torch.arange(max_len)[None, :] < torch.tensor(doc_lens, dtype=torch.int64).reshape(-1, 1)
    assert torch.equal(back[valid], x[valid]) and bool((back[~valid] == -1).all())


def test_pack_padded_gradient():
    layout = DocLayout.from_padded([2, 0, 3], 4)
    x = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(layout.pack_padded, (x,))
    packed = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(layout.unpack_padded, (packed,))
    layout.pack_padded(x).sum().backward()
    assert x.grad.sum(-1).tolist() == [[2, 2, 0, 0], [0, 0, 0, 0], [2, 2, 2, 0]]


# -- packed rows with sentinels ----------------------------------------------------------
@SETTINGS
@given(st.integers(1, 12).flatmap(lambda seq_len: st.tuples(
    st.just(seq_len),
    st.lists(st.lists(st.integers(0, seq_len), max_size=4), min_size=1, max_size=4),
    st.integers(0, 3))))
def test_packed_rows(case):
    """Rows of boundaries padded with the sentinel seq_len flatten to one stream."""
    seq_len, cuts, extra = case
    width = max(len(c) for c in cuts) + 2 + extra
    rows = [[0, *sorted(c)] + [seq_len] * (width - 1 - len(c)) for c in cuts]
    layout = DocLayout.from_packed_rows(rows, seq_len)
    lengths = [b - a for row in rows for a, b in zip(row[:-1], row[1:], strict=True)]
    assert layout.lengths.tolist() == lengths
    assert layout.num_tokens == len(rows) * seq_len and layout.rows == (len(rows), seq_len)
    # Row b's tokens are stream tokens [b*S, (b+1)*S): flattening [B, S, ...] is the stream.
    starts = torch.tensor(rows)[:, :-1] + torch.arange(len(rows))[:, None] * seq_len
    assert torch.equal(layout.cu_seqlens[:-1], starts.reshape(-1))
    assert torch.equal(DocLayout.from_packed_rows(torch.tensor(rows), seq_len).cu_seqlens, layout.cu_seqlens)


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("build, error, match", [
    (lambda: DocLayout.from_lengths([3, -1]), ValueError, ">= 0, got -1 at document 1"),
    (lambda: DocLayout.from_lengths([3, 1.5]), TypeError, "integers, got 1.5"),
    (lambda: DocLayout.from_lengths([3, 2.0]), TypeError, "integers"),
    (lambda: DocLayout.from_lengths([True, 2]), TypeError, "integers"),
    (lambda: DocLayout.from_lengths(["3"]), TypeError, "integers"),
    (lambda: DocLayout.from_lengths(torch.tensor([1.0, 2.0])), TypeError, "float"),
    (lambda: DocLayout.from_lengths(torch.tensor([True])), TypeError, "bool"),
    (lambda: DocLayout.from_lengths(5), TypeError, "sequence"),
    (lambda: DocLayout.from_lengths([[1, 2]]), TypeError, r"integers, got \[1, 2\]"),
    (lambda: DocLayout.from_lengths(torch.tensor([[1, 2]])), ValueError, "1-D"),
    (lambda: DocLayout.from_cu_seqlens([1, 4]), ValueError, "start at 0"),
    (lambda: DocLayout.from_cu_seqlens([]), ValueError, "start at 0"),
    (lambda: DocLayout.from_cu_seqlens([0, 5, 3]), ValueError, r"non-decreasing, but cu_seqlens\[2\]=3"),
    (lambda: DocLayout.from_cu_seqlens([0, 2.5]), TypeError, "integers"),
    (lambda: DocLayout.from_padded([2, 5], 4), ValueError, "max_len=4"),
    (lambda: DocLayout.from_padded([2, -1], 4), ValueError, "doc_lens"),
    (lambda: DocLayout.from_padded([2], 4.0), TypeError, "max_len must be an int"),
    (lambda: DocLayout.from_padded([2], -1), ValueError, "max_len must be in \\[0, "),
    (lambda: DocLayout.from_packed_rows([[0, 3, 8], [1, 4, 8]], 8), ValueError, "start at 0"),
    (lambda: DocLayout.from_packed_rows([[0, 3, 8], [0, 4, 7]], 8), ValueError, "end at seq_len=8"),
    (lambda: DocLayout.from_packed_rows([[0, 3, 8, 0]], 8), ValueError, "end at seq_len=8"),
    (lambda: DocLayout.from_packed_rows([[0, 5, 3, 8]], 8), ValueError, "non-decreasing"),
    (lambda: DocLayout.from_packed_rows([[0, 9, 8]], 8), ValueError, "non-decreasing"),
    (lambda: DocLayout.from_packed_rows([0, 3, 8], 8), ValueError, "2-D"),
    (lambda: DocLayout.from_packed_rows([[8]], 8), ValueError, "at least 2 columns"),
    (lambda: DocLayout.from_packed_rows([[0, 8], [0, 3, 8]], 8), ValueError, "rectangular"),
    (lambda: DocLayout.from_packed_rows([[0, 8]], "8"), TypeError, "seq_len must be an int"),
    (lambda: DocLayout.from_packed_rows([[0, 4.0, 8]], 8), TypeError, "integers"),
    (lambda: DocLayout.from_position_ids(torch.zeros(2, 4, dtype=torch.long)), ValueError, r"\[T\] or \[1, T\]"),
    (lambda: DocLayout.from_position_ids(torch.zeros(4)), TypeError, "integers"),
    (lambda: DocLayout.from_position_ids([[[0]]]), TypeError, r"integers, got \[0\]"),
])
def test_bad_input(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_tensor_shape_mismatch():
    padded = DocLayout.from_padded([2, 3], 4)
    with pytest.raises(ValueError, match=r"leading shape \[2, 4\]"):
        padded.pack_padded(torch.zeros(2, 5, 1))
    with pytest.raises(ValueError, match="layout holds 5 tokens"):
        padded.unpack_padded(torch.zeros(6, 1))
    plain = DocLayout.from_lengths([2, 3])
    with pytest.raises(ValueError, match="from_padded"):
        plain.padded_index()
    with pytest.raises(ValueError, match="from_padded"):
        plain.pack_padded(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"dimension 1 must match"):
        plain.check_tokens(torch.zeros(5, 4), "x", dim=1)
    plain.check_tokens(torch.zeros(2, 5), "x", dim=1)
