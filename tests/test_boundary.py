"""The library never depends on the application (``doccp.app``): it imports and runs without it."""

from __future__ import annotations

import importlib.util
import pkgutil
import subprocess
import sys

import doccp

#: Library modules that import an optional dependency at import time (the ``hf`` extra).
OPTIONAL = {"doccp.hf.trainer": "transformers"}


def library_modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(doccp.__path__, "doccp.")]
    missing = {n for n, dep in OPTIONAL.items() if importlib.util.find_spec(dep) is None}
    return sorted(n for n in names if n != "doccp.app" and not n.startswith("doccp.app.") and n not in missing)


def test_no_library_module_imports_the_application():
    modules = library_modules()
    assert "doccp.algorithms.allgather" in modules and "doccp.inference.prefill" in modules
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "leaked = sorted(m for m in sys.modules if m == 'doccp.app' or m.startswith('doccp.app.'))\n"
            "print(leaked)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"library modules imported the application: {proc.stdout}"
