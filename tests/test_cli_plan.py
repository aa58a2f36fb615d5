"""`doccp plan`, in process: tables, the text picture, the PNG, and one-line errors."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from doccp import DocLayout, Mask, plan
from doccp.app.cli.main import main
from doccp.app.plot import mask_image

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_valid_png(path) -> None:
    """Signature, then chunks whose CRCs check, from IHDR to IEND."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    at, kinds = 8, []
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body, (crc,) = data[at + 8:at + 8 + length], struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        assert zlib.crc32(kind + body) == crc
        kinds.append(kind)
        at += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    width, height = struct.unpack(">II", data[16:24])
    assert width > 200 and height > 200


def test_table(capsys):
    code, out, err = run(capsys, "--lengths", "48,56,58,35", "--world-size", "2")
    assert code == 0 and err == ""
    assert out.startswith("doccp plan: 4 documents, 197 tokens, 2 ranks, mask causal")
    stats = plan(DocLayout.from_lengths([48, 56, 58, 35]), 2).stats()
    assert stats.table() in out
    assert "balanced" in out and "head_tail" not in out
    picture = [line.split() for line in out.splitlines() if line.startswith("  doc ")]
    assert [row[2] for row in picture] == ["48", "56", "58", "35"]
    assert all(set(row[3]) <= {"0", "1"} and len(row[3]) == int(row[2]) for row in picture)


def test_all_strategies_with_plot(capsys, tmp_path):
    code, out, _ = run(capsys, "--lengths", "48 56 58 35", "-n", "3", "--mask", "window:8,2", "--strategy", "all",
                       "--plot", str(tmp_path / "plan.png"))
    assert code == 0 and "mask window(8,2)" in out
    comparison = out[out.index("strategy    imbalance"):].splitlines()
    assert [row.split()[0] for row in comparison[1:4]] == ["contiguous", "head_tail", "balanced"]
    for name in ("contiguous", "head_tail", "balanced"):
        assert f"wrote {tmp_path / f'plan-{name}.png'}" in out
        assert_valid_png(tmp_path / f"plan-{name}.png")


def test_lengths_file_and_plot(capsys, tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("# a comment\n100, 0, 1\n300\n  7 # trailing comment\n")
    png = tmp_path / "one.png"
    code, out, _ = run(capsys, "--lengths-file", str(lengths), "--world-size", "16", "--mask", "full",
                       "--strategy", "head_tail", "--plot", str(png))
    assert code == 0 and "5 documents, 408 tokens, 16 ranks, mask full" in out
    assert "  15 " in out  # a row per rank
    assert_valid_png(png)


def test_mask_image_colours_visible_cells_by_query_rank():
    p = plan(DocLayout.from_lengths([3, 0, 2]), 2, Mask.causal(), "contiguous")  # rank 0: tokens 0-2
    assert mask_image(p).tolist() == [[0, -1, -1, -1, -1], [0, 0, -1, -1, -1], [0, 0, 0, -1, -1],
                                      [-1, -1, -1, 1, -1], [-1, -1, -1, 1, 1]]
    big = plan(DocLayout.from_lengths([4000, 3000]), 4)
    image = mask_image(big, size=100)
    assert image.shape == (100, 100) and set(image.unique().tolist()) == {-1, 0, 1, 2, 3}
    above = torch.ones(100, 100, dtype=torch.bool).triu(1)
    assert bool((image[above] == -1).all())  # causal: nothing above the diagonal


@pytest.mark.parametrize("args, message", [
    (["--lengths", "48,x"], "--lengths: document lengths must be integers, got 'x'"),
    (["--lengths", "4.5"], "must be integers, got '4.5'"),
    (["--lengths", "48,-3"], "lengths must be >= 0, got -3 at document 1"),
    (["--lengths", ","], "no document lengths given"),
    ([], "exactly one of --lengths or --lengths-file"),
    (["--lengths", "4", "--lengths-file", "f"], "exactly one of --lengths or --lengths-file"),
    (["--lengths-file", "/nonexistent/lengths.txt"], "No such file"),
    (["--lengths", "4", "--world-size", "0"], "--world-size must be in [1, 65536], got 0"),
    (["--lengths", "4", "--world-size", "two"], "--world-size must be an integer >= 1, got 'two'"),
    (["--lengths", "4", "--mask", "diagonal"],
     "mask must be 'causal', 'full', 'window:LEFT[,RIGHT]' or 'chunked:SIZE'"),
    (["--lengths", "4", "--mask", "window:-2"], "Mask.left must be >= 0"),
    (["--lengths", "4", "--strategy", "zigzag"], "--strategy must be one of balanced, contiguous, head_tail or all"),
    (["--lengths", "4", "--plot", "/nonexistent/dir/p.png"], "No such file or directory"),
])
def test_bad_input_is_one_line_exit_2(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("doccp plan: error: ") and message in lines[0]


def test_space_separated_lengths_and_the_commands_own_usage(capsys):
    code, out, _ = run(capsys, "--lengths", "300", "40", "1000", "-n", "2")
    assert code == 0 and out.startswith("doccp plan: 3 documents, 1340 tokens, 2 ranks")
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--lengths", "300", "--bogus", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("usage: doccp plan ") and "doccp plan: error: unrecognized arguments: --bogus 1" in err


def test_picture_names_ranks_units_and_tiny_documents():
    from doccp.app.plot import plan_figure, tiny_documents

    p = plan(DocLayout.from_lengths([3000, 2, 0, 900]), 2)  # the 2-token document is under a pixel
    assert tiny_documents(p) == [1] and tiny_documents(plan(DocLayout.from_lengths([30, 3]), 2)) == []
    fig = plan_figure(p)
    ax_mask, ax_docs, ax_work = fig.axes
    assert [t.get_text() for t in ax_mask.get_legend().get_texts()] == [
        "rank 0", "rank 1", "not visible", "document under 3 px (1)"]
    stats = p.stats()
    bars = [t.get_text() for t in ax_work.texts]
    assert bars == [f"{stats.tokens[r]} tokens, {stats.pieces[r]} piece{'s' if stats.pieces[r] != 1 else ''}, "
                    f"KV received: {stats.kv_recv[r]} tokens" for r in range(2)]
    assert [t.get_text() for t in ax_docs.get_yticklabels()] == [
        "doc 0 (3000 tok)", "doc 1 (2 tok)", "doc 2 (0 tok)", "doc 3 (900 tok)"]
