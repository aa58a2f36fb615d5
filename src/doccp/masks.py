"""Attention masks on document-relative positions, and exact pair counting.

A mask is a band around the diagonal of one document: the query at document position
``i`` sees the key at document position ``j`` iff ``i - left <= j <= i + right``.
Because it is defined on positions, any chunk of a document is masked exactly by knowing
where the chunk starts; nothing downstream needs the whole document.

``causal`` is ``(inf, 0)``, ``full`` is ``(inf, inf)``, ``sliding_window(w)`` is ``(w, 0)``::

    causal        full          sliding_window(2)
    x . . . .     x x x x x     x . . . .
    x x . . .     x x x x x     x x . . .
    x x x . .     x x x x x     x x x . .
    x x x x .     x x x x x     . x x x .
    x x x x x     x x x x x     . . x x x
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Stand-in for an unbounded side of the band: farther than any position of any layout
#: (``DocLayout`` holds at most ``MAX_TOKENS = 2**31 - 1`` tokens) yet small enough that the
#: closed-form pair counts stay exact in int64. A window at least this wide is unbounded.
UNBOUNDED = 1 << 32
#: Largest window side a Mask accepts (int64); wider ones cannot be represented.
INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class Mask:
    """A band mask; ``None`` on a side means unbounded.

    A side of ``UNBOUNDED`` (2**32) or more reaches past every document, so it is stored as
    ``None``: ``Mask.sliding_window(10**12) == Mask.causal()``. Sides beyond int64 are rejected.
    """

    left: int | None = None
    right: int | None = 0

    def __post_init__(self) -> None:
        for name in ("left", "right"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Mask.{name} must be an int or None, got {type(value).__name__}")
            if value < 0:
                raise ValueError(
                    f"Mask.{name} must be >= 0 (a window cannot exclude the diagonal), got {value}"
                )
            if value > INT64_MAX:
                raise ValueError(f"Mask.{name}={value} cannot be represented (the limit is 2**63 - 1); "
                                 "use None for an unbounded side")
            if value >= UNBOUNDED:
                object.__setattr__(self, name, None)

    @classmethod
    def causal(cls) -> Mask:
        return cls(None, 0)

    @classmethod
    def full(cls) -> Mask:
        return cls(None, None)

    @classmethod
    def sliding_window(cls, left: int, right: int = 0) -> Mask:
        """Query ``i`` sees keys ``i-left .. i+right`` of its own document."""
        return cls(left, right)

    @classmethod
    def parse(cls, text: str) -> Mask:
        """Parse ``causal``, ``full`` or ``window:L[,R]`` (the CLI spelling)."""
        text = text.strip().lower()
        if text == "causal":
            return cls.causal()
        if text == "full":
            return cls.full()
        if text.startswith("window:"):
            parts = text[len("window:") :].split(",")
            try:
                values = [int(p) for p in parts]
            except ValueError:
                values = []
            if len(values) in (1, 2):
                return cls.sliding_window(*values)
        raise ValueError(f"mask must be 'causal', 'full' or 'window:LEFT[,RIGHT]', got {text!r}")

    # -- views -----------------------------------------------------------------------
    @property
    def left_bound(self) -> int:
        return UNBOUNDED if self.left is None else self.left

    @property
    def right_bound(self) -> int:
        return UNBOUNDED if self.right is None else self.right

    @property
    def is_causal(self) -> bool:
        return self.left is None and self.right == 0

    @property
    def is_full(self) -> bool:
        return self.left is None and self.right is None

    def window_size(self) -> tuple[int, int]:
        """flash-attention's ``(left, right)`` convention: ``-1`` for unbounded."""
        return (-1 if self.left is None else self.left, -1 if self.right is None else self.right)

    def __str__(self) -> str:
        if self.is_causal:
            return "causal"
        if self.is_full:
            return "full"
        right = "inf" if self.right is None else self.right
        left = "inf" if self.left is None else self.left
        return f"window({left},{right})"

    # -- geometry --------------------------------------------------------------------
    def visible_keys(self, q_start, q_end, doc_len):
        """Key range ``[lo, hi)`` seen by any query in ``[q_start, q_end)`` of a document.

        Works elementwise on ints or int64 tensors; empty ranges come out with ``hi <= lo``.
        """
        lo = _maximum(q_start - self.left_bound, 0)
        hi = _minimum(q_end + self.right_bound, doc_len)
        return lo, hi

    def pairs(self, q_start, q_end, k_start, k_end) -> torch.Tensor:
        """Exact number of visible (query, key) pairs between two ranges of one document.

        Elementwise over int64 tensors (or ints). The count is
        ``#{(i, j): q_start <= i < q_end, k_start <= j < k_end, -left <= j - i <= right}``
        computed in closed form, so it costs O(1) per range pair whatever their lengths.
        """
        qs, qe, ks, ke = (torch.as_tensor(x, dtype=torch.int64) for x in (q_start, q_end, k_start, k_end))
        nq = (qe - qs).clamp(min=0)
        nk = (ke - ks).clamp(min=0)
        upper = _pairs_below(nq, nk, self.right_bound - (ks - qs))
        lower = _pairs_below(nq, nk, -self.left_bound - 1 - (ks - qs))
        return upper - lower

    def row_costs(self, doc_len: int) -> torch.Tensor:
        """Visible keys of every query row of a document of ``doc_len`` tokens (int64)."""
        i = torch.arange(doc_len, dtype=torch.int64)
        lo, hi = self.visible_keys(i, i + 1, doc_len)
        return (hi - lo).clamp(min=0)


def _pairs_below(nq: torch.Tensor, nk: torch.Tensor, t: torch.Tensor | int) -> torch.Tensor:
    """``#{(x, y) in [0,nq) x [0,nk): y - x <= t}`` = sum_x clamp(x + t + 1, 0, nk)."""
    a = torch.as_tensor(t, dtype=torch.int64) + 1
    return _ramp_sum(a + nq, nk) - _ramp_sum(a, nk)


def _ramp_sum(z: torch.Tensor, nk: torch.Tensor) -> torch.Tensor:
    """``sum_{u=0}^{z-1} clamp(u, 0, nk)`` (0 for z <= 0), in closed form."""
    z = torch.clamp(torch.as_tensor(z, dtype=torch.int64), min=0)
    zc = torch.minimum(z, nk + 1)
    return zc * (zc - 1) // 2 + (z - zc) * nk


def _maximum(a, b):
    return torch.clamp(a, min=b) if isinstance(a, torch.Tensor) else max(a, b)


def _minimum(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return min(a, b)
