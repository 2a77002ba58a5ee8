"""The packages type-check: mypy, configured in pyproject.toml (``[tool.mypy]``), over engine/,
mods/, actors/ and pipelines/. A type error is often a real one waiting for its input (a path
that may be None, a frozenset handed out as a set, a variable reused with another type); the
check keeps new ones out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_packages_type_check(tmp_path):
    # mypy is one of the test extras: a missing one fails here, it is not skipped
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mypy found type errors (run `.venv/bin/python -m mypy`):\n{done.stdout}{done.stderr}"
    assert "Success: no issues found" in done.stdout
