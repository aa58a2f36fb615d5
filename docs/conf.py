"""Sphinx configuration of the doccp documentation site (``make docs``).

Sphinx, because doccp's docstrings are reStructuredText (``literals``, :func:`roles`, ``::``
blocks with ASCII pictures of masks and plans) and autodoc renders them as they are; the
guides are Markdown through myst-parser, so the README and the benchmark pages that
``doccp bench`` regenerates are included without conversion. Theme: furo.

Build-time content goes to ``_generated/`` (ignored by git): the plan pictures of the
concepts page (drawn by ``doccp.app.plot``, so they always show the current planner), the
``--help`` of every command, the table of the top-level names of the API reference, and the
toctree slot of a page that other work adds (docs/architecture.md): it is listed once its
file exists, and the build stays free of warnings until then.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GENERATED = HERE / "_generated"
sys.path.insert(0, str(HERE.parent / "src"))  # the checkout's doccp, also without an install

import doccp  # noqa: E402

project = "doccp"
author = "the doccp authors"
copyright = "the doccp authors"  # noqa: A001 (Sphinx's name)
release = version = doccp.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
napoleon_numpy_docstring = False  # a few docstrings use Google-style "Args:" sections
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# results/*.md are the sections benchmarks.md is assembled from (`doccp bench`); the page shows them.
exclude_patterns = ["_build", "_generated", "results"]

# doccp.hf imports transformers; a docs-only environment documents it without (pip install 'doccp[docs]').
autodoc_mock_imports = [name for name in ("transformers", "accelerate") if importlib.util.find_spec(name) is None]
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True}
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False  # not torch's docstrings on our overrides (autograd forward/backward)
python_maximum_signature_line_length = 100
add_module_names = False

html_theme = "furo"
html_title = f"doccp {release}"
html_static_path: list[str] = []


# -- generated content ----------------------------------------------------------------------------
def _write(path: Path, text: str) -> None:
    """Write only on change, so incremental builds stay incremental."""
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def _plan_pictures() -> None:
    from doccp.app.plot import plan_figure
    from doccp.plan import STRATEGIES

    layout = doccp.DocLayout.from_lengths([300, 40, 1000, 7, 700])  # the README's layout
    cases = {f"plan-{s}": (s, doccp.Mask.causal()) for s in STRATEGIES}
    cases["plan-balanced-window"] = ("balanced", doccp.Mask.sliding_window(128))
    for name, (strategy, mask) in cases.items():
        png = GENERATED / f"{name}.png"
        buffer = io.BytesIO()
        plan_figure(doccp.plan(layout, 4, mask, strategy)).savefig(buffer, dpi=80, format="png")
        if not png.is_file() or png.read_bytes() != buffer.getvalue():
            png.write_bytes(buffer.getvalue())


def _command_help() -> None:
    from doccp.app.cli.main import main

    for command in ("", "demo", "plan", "bench"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([command, "--help"] if command else ["--help"])
        _write(GENERATED / f"help-{command or 'doccp'}.txt", out.getvalue())


def _top_level_table() -> None:
    """The names of ``doccp.__all__``, each linked to where the reference documents it."""
    rows = ["| name | what it is |", "|---|---|"]
    for name in doccp.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(doccp, name)
        target = canonical_name(obj)
        summary = (obj.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        summary = re.sub(r":(\w+):`", r"{\1}`", summary)  # reStructuredText roles, as MyST writes them
        role = "mod" if isinstance(obj, type(doccp)) else "class" if isinstance(obj, type) else "func"
        rows.append(f"| {{py:{role}}}`doccp.{name} <{target}>` | {summary} |")
    _write(GENERATED / "top-level.md", "\n".join(rows) + "\n")


#: Modules whose pages document their members (the public path of each object).
DOCUMENTED_MODULES = ("doccp.layout", "doccp.masks", "doccp.plan", "doccp.shard", "doccp.varlen",
                      "doccp.algorithms", "doccp.inference", "doccp.interop.doc_packed", "doccp.interop.padded",
                      "doccp.nn", "doccp.hf", "doccp.launch", "doccp.checks", "doccp.agreement", "doccp.kernels")


def canonical_name(obj: object) -> str:
    """The name under which the API reference documents ``obj``: the first documented module
    that exports it, else where it is defined."""
    if isinstance(obj, type(doccp)):
        return obj.__name__
    for module_name in DOCUMENTED_MODULES:
        module = importlib.import_module(module_name)
        for attr in getattr(module, "__all__", ()) or vars(module):
            if getattr(module, attr, None) is obj:
                return f"{module_name}.{attr}"
    return f"{obj.__module__}.{obj.__qualname__}"


def _toctree(name: str, options: list[str], pages: list[str], later: list[str]) -> None:
    """A toctree of ``pages`` plus those of ``later`` that exist by now (pages other work adds),
    for the page that includes it where the slot is."""
    present = [page for page in later if (HERE / f"{page.lstrip('/')}.md").is_file()]
    _write(GENERATED / f"toc-{name}.md", "\n".join(["```{toctree}", *options, "", *pages, *present, "```", ""]))


GENERATED.mkdir(exist_ok=True)
_plan_pictures()
_command_help()
_top_level_table()
_toctree("background", [":caption: Background", ":maxdepth: 1", ":hidden:"], ["reliability", "benchmarks", "gpu"],
         ["architecture"])


# -- cross-references -----------------------------------------------------------------------------
def _resolve_alias(app, env, node, contnode):
    """Docstrings name objects by their public path (``doccp.attention``); the reference
    documents them where their module page is (``doccp.algorithms.attention``). Resolve the
    first through the second."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    if not target.startswith("doccp."):
        return None
    obj = _lookup(target)
    if obj is None or not (isinstance(obj, type(doccp)) or hasattr(obj, "__qualname__")):
        return None  # (data, such as a module's constants, is documented where it is defined)
    canonical = canonical_name(obj)
    if canonical == target:
        return None
    domain = env.get_domain("py")
    node = node.deepcopy()
    node["reftarget"] = canonical
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], canonical, node, contnode)


def _lookup(dotted: str) -> object | None:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def setup(app) -> None:
    app.connect("missing-reference", _resolve_alias)
