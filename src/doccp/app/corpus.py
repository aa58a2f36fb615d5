"""A real packed batch from a folder of text files, with no download and no tokenizer.

Tokens are bytes (vocabulary 256). Files are taken in a seeded random order, each becomes
one document (split into several when longer than ``max_doc_len``), and documents are
packed back to back until the batch holds ``tokens`` tokens (the last one is cut)::

    files   a.py (5000 B)        b.py (700 B)    c.py (12000 B) ...
    docs    [4096][ 904 ]        [ 700 ]         [4096][4096][3808] ...
    stream  |4096|904|700|4096|4096|38..|   <- tokens, with cu_seqlens at every |

By default the corpus is the running Python's standard library: present on every machine.
"""

from __future__ import annotations

import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from doccp.layout import DocLayout

VOCAB = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_dir() -> Path:
    """Where the running Python keeps its standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class Corpus:
    """The files of a corpus folder, in a stable (sorted) order, with their sizes."""

    root: Path
    files: tuple[Path, ...]
    sizes: tuple[int, ...]


def scan(root: str | os.PathLike, pattern: str = "*") -> Corpus:
    """List the non-empty files under ``root`` matching ``pattern`` (recursively).

    Raises ``ValueError`` for a missing or empty folder and ``OSError`` naming the first
    file that cannot be read, so a bad corpus fails before any work starts.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"corpus folder {str(root)!r} does not exist or is not a folder")
    files, sizes = [], []
    for path in sorted(root.rglob(pattern)):
        rel = path.relative_to(root).parts
        if any(part in _SKIP_DIRS or part.startswith(".") for part in rel) or path.is_dir():
            continue
        try:
            size = path.stat().st_size
        except OSError as e:
            raise OSError(f"cannot read corpus file {str(path)!r}: {e.strerror or e}") from None
        if not os.access(path, os.R_OK):
            raise OSError(f"cannot read corpus file {str(path)!r}: permission denied")
        if size > 0:
            files.append(path)
            sizes.append(size)
    if not files:
        raise ValueError(f"corpus folder {str(root)!r} holds no non-empty files matching {pattern!r}")
    return Corpus(root, tuple(files), tuple(sizes))


@dataclass(frozen=True)
class Batch:
    """A packed batch: byte tokens, their layout, and where each document came from."""

    tokens: torch.Tensor  # [T] int64 in [0, 256)
    layout: DocLayout
    sources: list[tuple[str, int]]  # (file relative to the corpus root, byte offset) per document

    @property
    def num_files(self) -> int:
        return len({name for name, _ in self.sources})


def pack(corpus: Corpus, tokens: int, max_doc_len: int = 4096, seed: int = 0) -> Batch:
    """Fill a batch of up to ``tokens`` byte tokens from the corpus (see module docstring).

    Deterministic for a given corpus, ``seed`` and sizes. The batch is shorter than
    ``tokens`` only when the whole corpus is.
    """
    if tokens < 1 or max_doc_len < 1:
        raise ValueError(f"tokens and max_doc_len must be >= 1, got {tokens} and {max_doc_len}")
    order = list(range(len(corpus.files)))
    random.Random(seed).shuffle(order)
    chunks, lengths, sources, left = [], [], [], tokens
    for i in order:
        if left == 0:
            break
        path = corpus.files[i]
        try:
            data = path.read_bytes()[:left]
        except OSError as e:
            raise OSError(f"cannot read corpus file {str(path)!r}: {e.strerror or e}") from None
        left -= len(data)
        chunks.append(data)
        for offset in range(0, len(data), max_doc_len):
            lengths.append(min(max_doc_len, len(data) - offset))
            sources.append((str(path.relative_to(corpus.root)), offset))
    stream = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).to(torch.int64)
    return Batch(stream, DocLayout.from_lengths(lengths), sources)
