#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install doccp into it.
#
# On a machine without an NVIDIA GPU this refuses to install a CUDA build of torch
# (several GB of nvidia-* wheels): it resolves torch first with `pip --dry-run` and
# stops with instructions if the resolution pulls CUDA packages.  Set
# DOCCP_TORCH_INDEX=https://download.pytorch.org/whl/cpu to take PyTorch's CPU index,
# or DOCCP_TORCH_SPEC to choose another torch requirement.
set -euo pipefail
venv=${1:-.venv}
torch_spec=${DOCCP_TORCH_SPEC:-torch==2.13.0}
py=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  echo "doccp setup: creating virtual environment $venv"
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
index_args=()
[ -n "${DOCCP_TORCH_INDEX:-}" ] && index_args=(--index-url "$DOCCP_TORCH_INDEX")

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    report=$(mktemp)
    "${pip[@]}" install --quiet --dry-run --ignore-installed --report "$report" "${index_args[@]}" "$torch_spec"
    if "$venv/bin/python" - "$report" <<'PY'
import json, sys
names = [i["metadata"]["name"] + "==" + i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]]
cuda = [n for n in names if n.lower().startswith("nvidia-") or "+cu" in n]
if cuda:
    print("doccp setup: no NVIDIA GPU here, but installing torch would pull CUDA packages:", *cuda[:5], sep="\n  ")
    print("Set DOCCP_TORCH_INDEX=https://download.pytorch.org/whl/cpu (or DOCCP_TORCH_SPEC) and run again.")
    sys.exit(1)
PY
    then rm -f "$report"; else rm -f "$report"; exit 1; fi
  fi
  echo "doccp setup: installing $torch_spec"
  "${pip[@]}" install --quiet "${index_args[@]}" "$torch_spec"
fi
echo "doccp setup: installing doccp (editable) with dev extras"
"${pip[@]}" install --quiet -e ".[dev]"
"$venv/bin/python" -c "import torch, doccp; print(f'doccp setup: torch {torch.__version__} (CUDA: {torch.cuda.is_available()}), doccp {doccp.__version__}')"
touch "$venv/.ready"
