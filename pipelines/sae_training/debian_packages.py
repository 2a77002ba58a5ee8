"""Debian packages as corpus sources: fetched by name with ``apt-get download``, unpacked once.

No install and no dependencies: the ``.deb`` is unpacked with ``dpkg-deb -x`` into a git-ignored
cache, so a fresh machine rebuilds exactly the same text from the package names and versions
recorded in the training report. apt's package index decides the version (run ``apt-get update``
first); a cached copy of another version is replaced by the one the index offers. A package that
cannot be fetched or unpacked raises :class:`CorpusSourceError` naming it and the command to fix it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from engine.errors import RaylensError

__all__ = ["CorpusSourceError", "fetch_package"]


class CorpusSourceError(RaylensError):
    """A corpus source is missing: its package cannot be downloaded or unpacked, or holds no text."""


def fetch_package(package: str, cache: Path) -> tuple[Path, str]:
    """Unpack ``package``'s ``.deb`` under ``cache/pkgs/<package>``; return the root and version.

    The unpacked copy is reused while it is the version apt's package index offers (or while the
    index knows no version: offline). After ``apt-get update`` brings a newer one, that one is
    downloaded, so the text follows the index the user chose rather than whatever came first."""
    root = cache / "pkgs" / package
    marker = root / ".raylens-version"
    have = marker.read_text().strip() if marker.is_file() else None
    wanted = _candidate_version(package)
    if have is not None and wanted in (None, have):
        return root, have
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise CorpusSourceError(f"the SAE corpus needs `{tool}` (Debian's apt/dpkg) to fetch {package!r}",
                                    parameter="package", value=package)
    found = _debs(debs, package, wanted)
    if not found:
        done = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
        found = _debs(debs, package, wanted)
        if (done.returncode != 0 or not found) and have is not None:
            print(f"raylens: cannot download {package} {wanted} (apt: {done.stderr.strip()[-200:]}); using the "
                  f"unpacked {have}", file=sys.stderr)
            return root, have
        if done.returncode != 0 or not found:
            raise CorpusSourceError(
                f"cannot download the Debian package {package!r} for the SAE corpus "
                f"(run `apt-get update` first; apt said: {done.stderr.strip()[-300:] or done.stdout.strip()[-300:]})",
                parameter="package", value=package)
    deb, version = found[-1]
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    done = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True, text=True)
    if done.returncode != 0:
        raise CorpusSourceError(f"cannot unpack {deb.name}: {done.stderr.strip()[-300:]}", parameter="package",
                                value=package)
    marker.write_text(version + "\n")
    return root, version


def _debs(debs: Path, package: str, wanted: str | None) -> list[tuple[Path, str]]:
    """Downloaded ``.deb`` files of ``package`` with their versions (only ``wanted`` when given)."""
    found = []
    for deb in sorted(debs.glob(f"{package}_*.deb")):
        version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True,
                                 text=True).stdout.strip()
        if wanted is None or version == wanted:
            found.append((deb, version))
    return found


def _candidate_version(package: str) -> str | None:
    """The version ``apt-get download`` would fetch, from the local package index (no network);
    None when apt is missing or the index does not know the package."""
    if shutil.which("apt-cache") is None:
        return None
    done = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "Candidate":
            value = value.strip()
            return None if value in ("", "(none)") else value
    return None


def _need(root: Path, relative: str) -> Path:
    path = root / relative
    if not path.exists():
        raise CorpusSourceError(f"{root.name} has no {relative}: the package layout changed",
                                parameter="package", value=root.name)
    return path
