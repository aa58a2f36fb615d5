"""`doccp bench`: runs bench scripts' main(argv), saves sections, assembles the page, and
writes the documented pages only for complete, successful, full runs.

Uses a throwaway checkout with trivial scripts: the real benchmarks are too heavy here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import doccp
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
DOCUMENTED = "# doccp benchmarks\n\nthe documented numbers\n"


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """A checkout with bench/ scripts and documented pages; the current directory."""
    bench = tmp_path / "bench"
    bench.mkdir()
    for name in SECTIONS:
        (bench / f"{name}.py").write_text(SCRIPT.format(name=name))
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (tmp_path / "docs" / "benchmarks.md").write_text(DOCUMENTED)
    (results / "cp.md").write_text("<!-- cp: 2025-01-01 00:00 UTC, old box -->\n## cp benchmark\n\nsaved table\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def documented(checkout: Path) -> dict[str, str]:
    docs = checkout / "docs"
    return {str(p.relative_to(docs)): p.read_text() for p in sorted(docs.rglob("*.md"))}


def test_quick_run_writes_its_out_dir_only(checkout, tmp_path_factory):
    before = documented(checkout)
    out = tmp_path_factory.mktemp("quick")
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    page = (out / "benchmarks.md").read_text()
    assert page.startswith("# doccp benchmarks")
    assert "cores" in page and "torch " in page  # machine description
    assert "doccp bench --quick --out DIR" in page  # how to reproduce
    positions = [page.index(f"## {name} benchmark") for name in SECTIONS]
    assert positions == sorted(positions)
    assert page.count("| ['--quick'] | 1.00 |") == len(SECTIONS)
    assert page.count("quick run._") == len(SECTIONS)
    assert sorted(p.name for p in (out / "results").iterdir()) == sorted(f"{n}.md" for n in SECTIONS)
    assert documented(checkout) == before


def test_quick_run_defaults_to_a_scratch_folder_and_refuses_docs(checkout, capsys):
    before = documented(checkout)
    assert main(["bench", "--quick", "--only", "plan"]) == 0
    assert "## plan benchmark" in (checkout / "doccp-bench" / "benchmarks.md").read_text()
    assert documented(checkout) == before
    assert main(["bench", "--quick", "--out", "docs"]) == 2
    assert "--quick results never replace the documented ones" in capsys.readouterr().err
    assert documented(checkout) == before


def test_complete_full_run_updates_the_docs(checkout):
    assert main(["bench", "--only", "plan"]) == 0
    page = (checkout / "docs" / "benchmarks.md").read_text()
    assert "| [] | 1.00 |" in page  # plan, a full run
    assert "saved table" in page and "_Measured 2025-01-01 00:00 UTC, old box._" in page  # cp kept
    assert "_Not measured yet: `doccp bench --only kernels`._" in page
    assert not (checkout / "doccp-bench").exists()


@pytest.mark.parametrize("broken", [
    "def main(argv=None):\n    print('## kernels partial')\n    raise RuntimeError('boom')\n",
    "def main(argv=None):\n    print('## kernels partial')\n    return 130\n",  # e.g. stopped by Ctrl-C
])
def test_failed_run_leaves_the_docs_alone(checkout, capsys, broken):
    (checkout / "bench" / "kernels.py").write_text(broken)
    before = documented(checkout)
    assert main(["bench", "--only", "plan,kernels"]) == 1
    err = capsys.readouterr().err
    assert "kernels failed or stopped early" in err and "is unchanged" in err
    assert "boom" in err or "exited with 130" in err
    assert documented(checkout) == before
    page = (checkout / "doccp-bench" / "benchmarks.md").read_text()
    assert "## plan benchmark" in page and "## kernels partial" in page
    assert "FAILED or interrupted: partial results" in page


def test_assemble_runs_nothing(checkout):
    (checkout / "bench" / "plan.py").write_text("def main(argv=None):\n    raise AssertionError('must not run')\n")
    assert main(["bench", "--assemble"]) == 0
    page = (checkout / "docs" / "benchmarks.md").read_text()
    assert "saved table" in page and "Not measured yet" in page


def test_script_may_return_its_markdown(checkout, tmp_path_factory):
    (checkout / "bench" / "plan.py").write_text("def main(argv=None):\n    return '## plan returned'\n")
    out = tmp_path_factory.mktemp("out")
    assert main(["bench", "--only", "plan", "--out", str(out)]) == 0
    assert "## plan returned" in (out / "benchmarks.md").read_text()


def test_finds_scripts_via_bench_dir_or_says_where_they_live(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--only", "plan", "--bench-dir", str(tmp_path / "nope")]) == 2
    assert "no benchmark folder at" in capsys.readouterr().err
    # an installed wheel: no bench/ here, none next to the package
    monkeypatch.setattr(doccp, "__file__", str(tmp_path / "site-packages" / "doccp" / "__init__.py"))
    assert main(["bench", "--quick", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "the benchmark scripts live in the doccp source repository" in err and "--bench-dir" in err
    assert not (tmp_path / "o").exists()


def test_bad_input(capsys):
    assert main(["bench", "--only", "plan,gpu"]) == 2
    assert capsys.readouterr().err.strip() == ("doccp bench: error: --only must list some of "
                                               "plan,optimum,kernels,cp,inference,hf, got 'plan,gpu'")
