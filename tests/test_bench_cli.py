"""`doccp bench`: runs bench scripts' main(argv), saves sections, assembles the page.

Uses a throwaway bench folder with trivial scripts: the real benchmarks are too heavy here.
"""

from __future__ import annotations

from pathlib import Path

from doccp.app.cli.bench import SECTIONS
from doccp.app.cli.main import main

SCRIPT = '''
def main(argv=None):
    print("## {name} benchmark")
    print()
    print("| argv | ratio |")
    print("|---|---|")
    print(f"| {{argv}} | 1.00 |")
'''


def _setup(tmp_path: Path, names=SECTIONS) -> tuple[Path, Path]:
    bench = tmp_path / "bench"
    bench.mkdir()
    for name in names:
        (bench / f"{name}.py").write_text(SCRIPT.format(name=name))
    return bench, tmp_path / "docs" / "benchmarks.md"


def test_runs_all_and_assembles(tmp_path, capsys):
    bench, out = _setup(tmp_path)
    assert main(["bench", "--quick", "--bench-dir", str(bench), "--out", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("# doccp benchmarks")
    assert "cores" in page and "torch " in page  # machine description
    assert "doccp bench --quick" in page  # how to reproduce
    positions = [page.index(f"## {name} benchmark") for name in SECTIONS]
    assert positions == sorted(positions)
    assert page.count("| ['--quick'] | 1.00 |") == len(SECTIONS)
    assert page.count("quick run._") == len(SECTIONS)
    assert sorted(p.name for p in (out.parent / "results").iterdir()) == sorted(f"{n}.md" for n in SECTIONS)


def test_only_keeps_saved_sections(tmp_path):
    bench, out = _setup(tmp_path, ["cp"])
    results = out.parent / "results"
    results.mkdir(parents=True)
    (results / "plan.md").write_text("<!-- plan: 2025-01-01 00:00 UTC, old box -->\n## plan benchmark\n\nsaved table\n")
    assert main(["bench", "--only", "cp", "--bench-dir", str(bench), "--out", str(out)]) == 0
    page = out.read_text()
    assert "saved table" in page and "_Measured 2025-01-01 00:00 UTC, old box._" in page
    assert "| [] | 1.00 |" in page  # cp re-run without --quick
    assert "_Not measured yet: `doccp bench --only kernels`._" in page


def test_assemble_runs_nothing(tmp_path):
    bench, out = _setup(tmp_path)
    (bench / "plan.py").write_text("def main(argv=None):\n    raise AssertionError('must not run')\n")
    assert main(["bench", "--assemble", "--bench-dir", str(bench), "--out", str(out)]) == 0
    assert "Not measured yet" in out.read_text()


def test_failing_script_keeps_others(tmp_path, capsys):
    bench, out = _setup(tmp_path, ["plan", "kernels"])
    (bench / "kernels.py").write_text("def main(argv=None):\n    raise RuntimeError('boom')\n")
    assert main(["bench", "--only", "plan,kernels", "--bench-dir", str(bench), "--out", str(out)]) == 1
    assert "boom" in capsys.readouterr().err
    assert "## plan benchmark" in out.read_text()


def test_script_may_return_its_markdown_or_an_exit_code(tmp_path, capsys):
    bench, out = _setup(tmp_path, ["plan", "kernels"])
    (bench / "plan.py").write_text("def main(argv=None):\n    return '## plan returned'\n")
    (bench / "kernels.py").write_text("def main(argv=None):\n    print('## kernels partial')\n    return 3\n")
    assert main(["bench", "--only", "plan,kernels", "--bench-dir", str(bench), "--out", str(out)]) == 1
    assert "kernels.py main([]) exited with 3" in capsys.readouterr().err
    page = out.read_text()
    assert "## plan returned" in page and "kernels partial" not in page


def test_bad_input(tmp_path, capsys):
    assert main(["bench", "--only", "plan,gpu"]) == 2
    assert capsys.readouterr().err.strip() == ("doccp bench: error: --only must list some of "
                                               "plan,kernels,cp,inference,hf, got 'plan,gpu'")
    assert main(["bench", "--bench-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "b.md")]) == 2
    assert "no benchmark folder" in capsys.readouterr().err
