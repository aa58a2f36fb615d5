"""Documents in a packed token stream, and the input formats that convert to it.

Every input format converts to a :class:`DocLayout` (cumulative document boundaries over
one packed stream); nothing downstream knows which format the user started from.

=================  ==========================================  ===========================
format             tensors                                     constructor
=================  ==========================================  ===========================
THD / varlen       ``[T, ...]`` + ``cu_seqlens [D+1]``          ``from_cu_seqlens``
lengths            ``[T, ...]`` + document lengths              ``from_lengths``
padded             ``[B, L, ...]`` + one length per row         ``from_padded``
packed rows        ``[B, S, ...]`` + ``cu_rows [B, M+1]``       ``from_packed_rows``
=================  ==========================================  ===========================

All of this is host-side bookkeeping on int64 CPU tensors, computed once per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from doccp.ranges import repeat

IntsLike = Sequence[int] | torch.Tensor

#: Most tokens a layout may hold: cu_seqlens fit in int32 (what varlen kernels take) and exact
#: pair counts of any two ranges fit in int64.
MAX_TOKENS = (1 << 31) - 1


def as_int_tensor(values: IntsLike, name: str, *, ndim: int = 1) -> torch.Tensor:
    """Validate integer input and return it as an int64 CPU tensor (never syncs a GPU
    tensor silently: a device tensor is accepted but copied once, here, on the host side)."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a {values.dtype} tensor")
        tensor = values.detach().to("cpu", torch.int64)
    else:
        try:
            items = list(values)
        except TypeError:
            raise TypeError(f"{name} must be a sequence of ints or an integer tensor") from None
        flat = items
        try:
            for _ in range(ndim - 1):
                flat = [x for row in flat for x in row]
        except TypeError:
            raise ValueError(f"{name} must be {ndim}-D (a list of rows), got {items[:4]!r}") from None
        bad = [x for x in flat if isinstance(x, bool) or not isinstance(x, int) and not _is_int_scalar(x)]
        if bad:
            raise TypeError(f"{name} must hold integers, got {bad[0]!r}")
        huge = next((x for x in flat if not -MAX_INT64 <= int(x) <= MAX_INT64), None)
        if huge is not None:
            raise ValueError(f"{name} holds {int(huge)}, which does not fit in int64")
        try:
            tensor = torch.tensor(items, dtype=torch.int64) if items else torch.zeros(0, dtype=torch.int64)
        except ValueError as e:  # ragged rows
            raise ValueError(f"{name} must be a rectangular {ndim}-D array: {e}") from None
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    return tensor


MAX_INT64 = (1 << 63) - 1


def _is_int_scalar(x: object) -> bool:
    return hasattr(x, "__index__") and not isinstance(x, float)


@dataclass(frozen=True, eq=False)
class DocLayout:
    """Documents packed back to back in one stream of ``num_tokens`` tokens.

    ``cu_seqlens[d]`` is where document ``d`` starts; ``cu_seqlens[-1]`` is the stream length.
    Zero-length documents are allowed anywhere (they hold no token).
    """

    cu_seqlens: torch.Tensor
    #: For layouts from a padded or packed-rows batch: ``(B, row_len)`` of that batch.
    rows: tuple[int, int] | None = None
    #: For a padded batch: where each packed token sits in the flattened ``[B*L]`` batch.
    _padded_index: torch.Tensor | None = field(default=None, repr=False)

    # -- constructors ------------------------------------------------------------------
    @classmethod
    def from_lengths(cls, lengths: IntsLike) -> DocLayout:
        lengths = as_int_tensor(lengths, "lengths")
        if (lengths < 0).any():
            raise ValueError(f"lengths must be >= 0, got {lengths[lengths < 0][0].item()} at "
                             f"document {int((lengths < 0).nonzero()[0])}")
        return cls(_cumsum0(lengths))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: IntsLike) -> DocLayout:
        cu = as_int_tensor(cu_seqlens, "cu_seqlens")
        if cu.numel() and int(cu[-1]) > MAX_TOKENS:
            raise ValueError(f"cu_seqlens ends at {int(cu[-1])} tokens, more than a layout holds "
                             f"(MAX_TOKENS = 2**31 - 1 = {MAX_TOKENS})")
        if cu.numel() == 0 or cu[0] != 0:
            raise ValueError("cu_seqlens must start at 0 (e.g. [0, 5, 9] for documents of 5 and 4 "
                             f"tokens), got {cu[:4].tolist()}")
        if (cu[1:] < cu[:-1]).any():
            where = int((cu[1:] < cu[:-1]).nonzero()[0])
            raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{where + 1}]="
                             f"{int(cu[where + 1])} < cu_seqlens[{where}]={int(cu[where])}")
        return cls(cu.clone())

    @classmethod
    def from_position_ids(cls, position_ids: IntsLike) -> DocLayout:
        """Documents of a padding-free stream from its per-token positions (``[T]`` or ``[1, T]``).

        A document starts wherever the position does not continue the previous one
        (``position_ids[i] != position_ids[i-1] + 1``), the rule Hugging Face transformers
        uses for packed sequences, so any start value works (``DataCollatorWithFlattening``'s
        ``position_ids_start``). Zero-length documents cannot be expressed this way.
        """
        pos = as_int_tensor(position_ids, "position_ids", ndim=2 if _is_2d(position_ids) else 1)
        if pos.dim() == 2:
            if pos.shape[0] != 1:
                raise ValueError(f"position_ids must be [T] or [1, T] (one packed stream), got shape "
                                 f"{tuple(pos.shape)}; flatten the batch (DataCollatorWithFlattening)")
            pos = pos[0]
        if pos.numel() == 0:
            return cls(torch.zeros(1, dtype=torch.int64))
        if pos.numel() > MAX_TOKENS:
            raise ValueError(f"position_ids hold {pos.numel()} tokens, more than a layout holds "
                             f"(MAX_TOKENS = 2**31 - 1 = {MAX_TOKENS})")
        starts = torch.nonzero(torch.diff(pos) != 1).flatten() + 1
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), starts, torch.tensor([pos.numel()])])
        return cls(bounds)

    @classmethod
    def from_padded(cls, doc_lens: IntsLike, max_len: int) -> DocLayout:
        """One document per row of a padded ``[B, max_len, ...]`` batch (tokens left-aligned).

        The packed stream is the rows' valid tokens concatenated; :meth:`padded_index` maps
        them back into the flattened batch.
        """
        lens = as_int_tensor(doc_lens, "doc_lens")
        _check_int(max_len, "max_len", minimum=0)
        if (lens < 0).any() or (lens > max_len).any():
            raise ValueError(f"doc_lens must lie in [0, max_len={max_len}], got {lens.tolist()[:8]}")
        layout = cls(_cumsum0(lens), rows=(lens.numel(), max_len))
        rows = repeat(torch.arange(lens.numel()), lens)
        index = rows * max_len + layout.positions()
        object.__setattr__(layout, "_padded_index", index)
        return layout

    @classmethod
    def from_packed_rows(cls, cu_rows: IntsLike, seq_len: int) -> DocLayout:
        """Rows ``[B, MAX_DOCS+1]`` of cumulative boundaries, one row per batch row.

        Each row starts at 0 and ends at ``seq_len``; unused trailing entries repeat
        ``seq_len`` (zero-length documents), so every row has the same shape. The packed
        stream is the rows concatenated, so a ``[B, S, ...]`` tensor flattens to it directly.
        """
        cu = as_int_tensor(cu_rows, "cu_rows", ndim=2)
        _check_int(seq_len, "seq_len", minimum=0)
        if cu.shape[1] < 2:
            raise ValueError(f"cu_rows must have at least 2 columns ([B, MAX_DOCS+1]), got {tuple(cu.shape)}")
        if (cu[:, 0] != 0).any():
            raise ValueError("every row of cu_rows must start at 0, got row "
                             f"{int((cu[:, 0] != 0).nonzero()[0])}: {cu[(cu[:, 0] != 0)][0].tolist()}")
        if (cu[:, -1] != seq_len).any():
            row = int((cu[:, -1] != seq_len).nonzero()[0])
            raise ValueError(f"every row of cu_rows must end at seq_len={seq_len} (pad unused "
                             f"entries with the sentinel {seq_len}), got row {row}: {cu[row].tolist()}")
        if (cu[:, 1:] < cu[:, :-1]).any():
            row = int((cu[:, 1:] < cu[:, :-1]).any(1).nonzero()[0])
            raise ValueError(f"cu_rows must be non-decreasing along each row, got row {row}: "
                             f"{cu[row].tolist()}")
        lengths = (cu[:, 1:] - cu[:, :-1]).reshape(-1)
        return cls(_cumsum0(lengths), rows=(cu.shape[0], seq_len))

    # -- properties --------------------------------------------------------------------
    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def max_len(self) -> int:
        return int(self.lengths.max()) if self.num_docs else 0

    def doc_ids(self) -> torch.Tensor:
        """Document of every token of the stream, ``[num_tokens]`` int64."""
        return repeat(torch.arange(self.num_docs), self.lengths, self.num_tokens)

    def positions(self) -> torch.Tensor:
        """Document-relative position of every token (what RoPE wants), ``[num_tokens]``."""
        starts = repeat(self.cu_seqlens[:-1], self.lengths, self.num_tokens)
        return torch.arange(self.num_tokens) - starts

    def next_token_targets(self, tokens: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Language-model targets for a packed stream: the next token *of the same document*,
        ``ignore_index`` on each document's last token (nothing follows it there). Shift the
        labels of the whole stream like this before sharding: a shard's last token's target
        usually lives on another rank."""
        self.check_tokens(tokens, "tokens")
        targets = torch.full_like(tokens, ignore_index)
        targets[:-1] = tokens[1:]
        last = self.cu_seqlens[1:][self.lengths > 0] - 1
        targets[last.to(tokens.device)] = ignore_index
        return targets

    # -- index maps between batch formats and the packed stream -------------------------
    def padded_index(self) -> torch.Tensor:
        """For a padded layout: flat index into ``[B * max_len]`` of every packed token."""
        if self._padded_index is None:
            raise ValueError("padded_index() needs a layout built with DocLayout.from_padded")
        return self._padded_index

    def pack_padded(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, max_len, ...]`` padded batch -> ``[T, ...]`` packed stream (differentiable)."""
        b, length = self._rows_shape(x, "from_padded")
        return x.reshape(b * length, *x.shape[2:]).index_select(0, self.padded_index().to(x.device))

    def unpack_padded(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[T, ...]`` packed stream -> ``[B, max_len, ...]`` with ``fill`` in padding."""
        self.check_tokens(x, "x")
        assert self.rows is not None
        b, length = self.rows
        out = x.new_full((b * length, *x.shape[1:]), fill)
        out = out.index_copy(0, self.padded_index().to(x.device), x)
        return out.reshape(b, length, *x.shape[1:])

    def _rows_shape(self, x: torch.Tensor, ctor: str) -> tuple[int, int]:
        if self.rows is None:
            raise ValueError(f"this layout has no batch rows; build it with DocLayout.{ctor}")
        b, length = self.rows
        if x.dim() < 2 or tuple(x.shape[:2]) != (b, length):
            raise ValueError(f"x must have leading shape [{b}, {length}] to match the layout, "
                             f"got {tuple(x.shape)}")
        return b, length

    def check_tokens(self, x: torch.Tensor, name: str, dim: int = 0) -> None:
        """Raise a clear error unless ``x.shape[dim]`` is the stream length."""
        if x.dim() <= dim or x.shape[dim] != self.num_tokens:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, but the layout holds "
                             f"{self.num_tokens} tokens (dimension {dim} must match)")

    def __repr__(self) -> str:
        lens = self.lengths.tolist()
        shown = ", ".join(map(str, lens[:8])) + (", ..." if len(lens) > 8 else "")
        return f"DocLayout(num_docs={self.num_docs}, num_tokens={self.num_tokens}, lengths=[{shown}])"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DocLayout) and torch.equal(self.cu_seqlens, other.cu_seqlens)

    def __hash__(self) -> int:
        return hash(tuple(self.cu_seqlens.tolist()))


def _cumsum0(lengths: torch.Tensor) -> torch.Tensor:
    """Cumulative boundaries, refusing totals beyond ``MAX_TOKENS`` (before they can overflow)."""
    if lengths.numel() and int(lengths.max()) > MAX_TOKENS:
        raise ValueError(f"a document of {int(lengths.max())} tokens is longer than a layout holds "
                         f"(MAX_TOKENS = 2**31 - 1 = {MAX_TOKENS})")
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    if int(cu[-1]) > MAX_TOKENS:  # each length <= 2**31, so the sum cannot wrap below 2**63
        raise ValueError(f"the documents hold {int(cu[-1])} tokens, more than a layout holds "
                         f"(MAX_TOKENS = 2**31 - 1 = {MAX_TOKENS}); split the batch")
    return cu


def _check_int(value: object, name: str, minimum: int, maximum: int = MAX_TOKENS) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")


def _is_2d(values: IntsLike) -> bool:
    if isinstance(values, torch.Tensor):
        return values.dim() == 2
    first = next(iter(values), None)
    return first is not None and not isinstance(first, int) and hasattr(first, "__len__")
