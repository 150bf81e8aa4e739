#!/usr/bin/env bash
# Create .venv (Python >= 3.12) in the checkout and install jaxlp into it.
#   bash scripts/setup.sh          # the package (enough for `jaxlp demo`)
#   bash scripts/setup.sh --dev    # plus the test and reference dependencies (torch, transformers, ...)
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for candidate in python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      echo "$candidate"; return
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -V -r); do
      echo "env PYENV_VERSION=$v python${v%.*}"; return
    done
  fi
  echo "setup.sh: no Python >= 3.12 found (jax 0.11 needs it)" >&2; exit 1
}

if [ ! -x .venv/bin/python ]; then
  $(find_python) -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "${1:-}" = "--dev" ]; then
  .venv/bin/python -m pip install -q -e ".[dev]"
  # CUTLASS's C++ headers, which the CUTLASS kernels are built from (the build's tests read them);
  # --no-deps: its Python tools' dependencies (cuda-python, ...) are not needed for the headers.
  .venv/bin/python -m pip install -q --no-deps "nvidia-cutlass==4.2.0.0"
else
  .venv/bin/python -m pip install -q -e .
fi
