"""`doccp demo` end to end (subprocess, as a user runs it) and its bad-input handling."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from doccp.app.cli.main import main
from doccp.app.corpus import pack, scan
from doccp.layout import DocLayout

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _doccp(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "doccp.app.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "out"
    proc = _doccp("demo", "--world-size", "2", "--tokens", "4096", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = proc.stdout
    assert "4096 byte tokens" in report and "2 CP ranks" in report
    for strategy in ("contiguous", "head_tail", "balanced"):
        assert f"| {strategy} |" in report
    for run in ("1 process", "allgather", "ring_kv"):  # training, against one process
        assert f"| {run} | 5." in report
    assert "| pass_kv | yes |" in report and "| pass_q | yes |" in report  # generation
    assert "FAIL" not in report
    training = next(line for line in report.splitlines() if line.startswith("- training: "))
    assert "match one process" in training and all(name in training for name in ("allgather", "ring_kv", "ulysses"))
    assert "## Summary" in report and report.rstrip().splitlines()[-1].startswith("PASS in ")
    assert (out / "report.md").read_text().strip() == report.strip()
    pngs = sorted(out.glob("plan-*.png"))
    assert [p.name for p in pngs] == ["plan-balanced.png", "plan-contiguous.png", "plan-head_tail.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)


def test_module_entry_point_help():
    proc = subprocess.run([sys.executable, "-m", "doccp.app.demo", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    for flag in ("--corpus", "--tokens", "--max-doc-len", "--world-size", "--mask", "--strategy", "--algorithms",
                 "--decode-tokens", "--dtype", "--backend", "--threads", "--out", "torchrun"):
        assert flag in proc.stdout


def _error(capsys, *args: str) -> str:
    code = main(["demo", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) >= 1 and err[-1].startswith("doccp demo: error: ")
    return err[-1]


def test_bad_numbers(capsys):
    assert "--world-size must be in [1, 4096]" in _error(capsys, "--world-size", "0")
    assert "--tokens (2) must be at least --world-size (4)" in _error(capsys, "--tokens", "2")
    assert "--algorithms" in _error(capsys, "--algorithms", "ring_q")
    assert "hybrid cannot run the demo's model on 2 ranks" in _error(capsys, "--algorithms", "hybrid",
                                                                       "--world-size", "2")
    assert "4 query heads are not a multiple of 3" in _error(capsys, "--algorithms", "ulysses", "--world-size", "3")
    assert "mask must be" in _error(capsys, "--mask", "diagonal")
    assert "needs one process per GPU" in _error(capsys, "--backend", "nccl")


def test_bad_corpus(tmp_path, capsys):
    assert "does not exist" in _error(capsys, "--corpus", str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no non-empty files" in _error(capsys, "--corpus", str(empty))
    (empty / "zero.txt").write_text("")
    assert "holds no non-empty files" in _error(capsys, "--corpus", str(empty))
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "a.txt").write_text("abc")
    assert "only 3 tokens, fewer than the 4 ranks" in _error(capsys, "--corpus", str(tiny), "--out",
                                                              str(tmp_path / "o"))


def test_unreadable_file(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "ok.txt").write_text("hello world " * 100)
    (corpus / "gone.txt").symlink_to(corpus / "nowhere.txt")
    assert "cannot read corpus file" in _error(capsys, "--corpus", str(corpus))
    if os.geteuid() != 0:  # root reads anything; a dangling link is unreadable for everyone
        (corpus / "gone.txt").unlink()
        locked = corpus / "locked.txt"
        locked.write_text("secret")
        locked.chmod(0)
        assert "locked.txt" in _error(capsys, "--corpus", str(corpus))


def test_bad_input_exit_code_from_console():
    proc = subprocess.run([sys.executable, "-m", "doccp.app.cli.main", "demo", "--world-size", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "doccp demo: error: --world-size must be in [1, 4096], got 0"


def test_pack_is_deterministic_and_splits_long_files(tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i, size in enumerate([10, 2500, 7, 1000]):
        (corpus / f"f{i}.txt").write_bytes(bytes(range(97, 97 + 26)) * (size // 26) + b"z" * (size % 26))
    files = scan(corpus)
    a, b = pack(files, 3000, max_doc_len=1024, seed=3), pack(files, 3000, max_doc_len=1024, seed=3)
    assert a.layout == b.layout and a.tokens.equal(b.tokens) and a.sources == b.sources
    assert a.layout.num_tokens == 3000 and int(a.layout.lengths.max()) <= 1024
    assert int(a.tokens.max()) < 256
    whole = pack(files, 10_000, max_doc_len=1024, seed=3)
    assert whole.layout.num_tokens == 10 + 2500 + 7 + 1000  # the corpus is smaller than asked
    assert sorted(whole.layout.lengths.tolist()) == sorted([10, 1024, 1024, 452, 7, 1000])
    with pytest.raises(ValueError):
        pack(files, 0)


def test_next_token_targets_stay_in_documents():
    layout = DocLayout.from_lengths([3, 0, 2])
    targets = layout.next_token_targets(torch.tensor([1, 2, 3, 4, 5]))
    assert targets.tolist() == [2, 3, -100, 5, -100]
