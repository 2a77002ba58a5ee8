"""Debian packages as corpus sources: fetched by name with ``apt-get download``, unpacked once.

No install and no dependencies: the ``.deb`` is unpacked with ``dpkg-deb -x`` into a git-ignored
cache, so a fresh machine rebuilds exactly the same text from the package names and versions
recorded in the training report. A package that cannot be fetched or unpacked raises
:class:`CorpusSourceError` naming it and the command to fix it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from engine.errors import RaylensError

__all__ = ["CorpusSourceError", "fetch_package"]


class CorpusSourceError(RaylensError):
    """A corpus source is missing: its package cannot be downloaded or unpacked, or holds no text."""


def fetch_package(package: str, cache: Path) -> tuple[Path, str]:
    """Unpack ``package``'s ``.deb`` under ``cache/pkgs/<package>`` (once); return the root and version."""
    root = cache / "pkgs" / package
    marker = root / ".raylens-version"
    if marker.is_file():
        return root, marker.read_text().strip()
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise CorpusSourceError(f"the SAE corpus needs `{tool}` (Debian's apt/dpkg) to fetch {package!r}",
                                    parameter="package", value=package)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        done = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
        found = sorted(debs.glob(f"{package}_*.deb"))
        if done.returncode != 0 or not found:
            raise CorpusSourceError(
                f"cannot download the Debian package {package!r} for the SAE corpus "
                f"(run `apt-get update` first; apt said: {done.stderr.strip()[-300:] or done.stdout.strip()[-300:]})",
                parameter="package", value=package)
    deb = found[-1]
    version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True).stdout.strip()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    done = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True, text=True)
    if done.returncode != 0:
        raise CorpusSourceError(f"cannot unpack {deb.name}: {done.stderr.strip()[-300:]}", parameter="package",
                                value=package)
    marker.write_text(version + "\n")
    return root, version


def _need(root: Path, relative: str) -> Path:
    path = root / relative
    if not path.exists():
        raise CorpusSourceError(f"{root.name} has no {relative}: the package layout changed",
                                parameter="package", value=root.name)
    return path
