"""The SAE corpus builder's pure parts: readers, hold-out split, and the error for a missing source."""

from __future__ import annotations

import struct

import pytest

from pipelines.sae_training import corpus, corpus_readers, debian_packages
from pipelines.sae_training.debian_packages import CorpusSourceError, fetch_package
from pipelines.sae_training.train import _holdout


def test_a_missing_package_tool_is_a_clear_typed_error(tmp_path, monkeypatch):
    monkeypatch.setattr(debian_packages.shutil, "which", lambda tool: None)
    with pytest.raises(CorpusSourceError, match="apt-get.*fortunes"):
        fetch_package("fortunes", tmp_path)


def test_a_source_whose_files_are_missing_names_the_package(tmp_path):
    root = tmp_path / "wordnet-base"
    root.mkdir()
    with pytest.raises(CorpusSourceError, match="wordnet-base has no usr/share/wordnet/data.noun"):
        corpus_readers._read_wordnet(root)


def test_man_pages_become_plain_text():
    source = '.\\" comment\n.TH pipe 7\n.SH NAME\npipe \\- overview of pipes\n.PP\nA pipe is created with\n' \
             '.BR pipe (2),\nwhich has a\n.I read end\n\\[bu] done\n'
    text = corpus_readers._man_text(source)
    assert "comment" not in text and ".TH" not in text
    assert "pipe - overview of pipes" in text and "pipe(2)," in text and "read end" in text and "• done" in text


def _info_file(nodes: list[tuple[str, str]]) -> bytes:
    import gzip

    body = "This is tool.info, produced by makeinfo.\n\n"
    for name, text in nodes:
        body += f"\x1f\nFile: tool.info,  Node: {name},  Up: Top\n\n{text}\n"
    return gzip.compress((body + "\x1f\nTag Table:\nNode: Top\x7f100\n\x1f\nEnd Tag Table\n").encode())


def test_info_manuals_become_prose_without_menus_headings_licence_or_index(tmp_path):
    info = tmp_path / "usr/share/info"
    info.mkdir(parents=True)
    usage = ("1 Using the tool\n****************\n\nThe tool reads every file named on its command line and "
             "writes\nwhat it found to standard output, one line per match, in the order the\nfiles were given. "
             "When no file is named it reads standard input instead, so it\ncan sit in a pipeline.\n\n"
             "* Menu:\n\n* Options::     What the options do.\n* Exit status::  What it returns.\n")
    (info / "tool.info.gz").write_bytes(_info_file([
        ("Top", "tool\n****\n\nThis manual is for the tool. Copyright (C) the authors. " + "x" * 200),
        ("Usage", usage),
        ("GNU Free Documentation License", "Version 1.3, 3 November 2008. " + "licence text " * 40),
        ("Index", "* options:    Usage.   (line 6) " * 20),
    ]))
    chunks = corpus_readers._read_info("tool")(tmp_path)
    assert chunks == ["1 Using the tool\n\nThe tool reads every file named on its command line and writes what it "
                      "found to standard output, one line per match, in the order the files were given. When no file "
                      "is named it reads standard input instead, so it can sit in a pipeline."]
    with pytest.raises(CorpusSourceError, match="no Info manual 'other'"):
        corpus_readers._read_info("other")(tmp_path)


def _xdr_strings(values: list[str]) -> bytes:
    body = struct.pack(">i", 16) + struct.pack(">i", len(values))
    for value in values:
        raw = value.encode()
        body += struct.pack(">i", 9 | (1 << 15)) + struct.pack(">i", len(raw)) + raw
    return b"X\n" + struct.pack(">iii", 3, 0x40201, 0x30500) + struct.pack(">i", 5) + b"UTF-8" + body


def test_the_r_reader_reads_a_character_vector():
    assert corpus_readers._R(_xdr_strings(["EMMA", "", "By Jane Austen"])).read() == ["EMMA", "", "By Jane Austen"]


def test_the_code_chunker_keeps_indentation():
    chunks = corpus_readers._code_chunks("def f():\n    return 1\n\n\nclass A:\n    x = 2\n", size=10)
    assert chunks == ["def f():\n    return 1", "class A:\n    x = 2"]


def test_every_kind_keeps_its_last_sequences_for_the_held_out_set():
    kinds = ["prose"] * 40 + ["chat"] * 20 + ["code"] * 10
    held = _holdout(kinds, 0.1)
    assert held[36:40] == [True] * 4 and not any(held[:36])
    assert held[58:60] == [True] * 2 and not any(held[40:58])
    assert held[68:70] == [True] * 2 and sum(held) == 8


@pytest.mark.parametrize("name", ["broad", "broad-manuals"])
def test_every_source_names_a_package_and_a_licence(name):
    sources = corpus.CORPORA[name].sources
    assert len({s.name for s in sources}) == len(sources)
    for source in sources:
        assert source.package and source.licence and source.weight > 0 and source.kind in ("prose", "code")
    assert sum(corpus.CORPORA[name].shares.values()) == pytest.approx(1.0)


def test_broad_manuals_is_the_broad_corpus_with_the_gnu_manuals_in_its_prose():
    broad, manuals = corpus.CORPORA["broad"], corpus.CORPORA["broad-manuals"]
    by_name = {s.name: s for s in manuals.sources}
    assert [s.name for s in manuals.sources] == ([s.name for s in broad.sources if s.kind == "prose"]
                                                 + [s.name for s in corpus.MANUAL_SOURCES]
                                                 + [s.name for s in broad.sources if s.kind == "code"])
    assert all(by_name[s.name].weight == s.weight for s in broad.sources if s.kind == "code")
    prose = [s for s in manuals.sources if s.kind == "prose"]
    assert sum(s.weight for s in corpus.MANUAL_SOURCES) / sum(s.weight for s in prose) == pytest.approx(0.2, abs=0.01)


def test_an_unknown_corpus_name_is_a_config_error_naming_the_choices():
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="broad-manuals"):
        corpus.build_corpus(None, 1, 16, corpus="manuals")


class _FakeApt:
    """apt-get download / dpkg-deb for one package whose index offers ``candidate``."""

    def __init__(self, debs, candidate):
        self.debs, self.candidate, self.download_works, self.downloads = debs, candidate, True, 0

    def run(self, argv, cwd=None, capture_output=True, text=True):
        import subprocess

        if argv[:2] == ["apt-get", "download"]:
            self.downloads += 1
            if self.download_works:
                (self.debs / f"{argv[2]}_{self.candidate}_all.deb").write_text(self.candidate)
            return subprocess.CompletedProcess(argv, 0 if self.download_works else 100, "", "offline")
        if argv[:2] == ["dpkg-deb", "-f"]:
            return subprocess.CompletedProcess(argv, 0, open(argv[2]).read() + "\n", "")
        if argv[:2] == ["dpkg-deb", "-x"]:
            (debian_packages.Path(argv[3]) / "text").write_text(open(argv[2]).read())
            return subprocess.CompletedProcess(argv, 0, "", "")
        raise AssertionError(argv)


@pytest.mark.parametrize("candidate, download_works, expected, downloads", [
    ("1.0", True, "1.0", 0),    # the index offers the cached version: reused
    (None, True, "1.0", 0),     # no index entry (offline, no apt-cache): reused
    ("2.0", True, "2.0", 1),    # apt-get update brought 2.0: fetched and unpacked
    ("2.0", False, "1.0", 1),   # ... but cannot be downloaded: the unpacked 1.0 stays in use
])
def test_a_cached_package_follows_the_version_apts_index_offers(tmp_path, monkeypatch, candidate, download_works,
                                                                expected, downloads):
    debs = tmp_path / "debs"
    debs.mkdir()
    fake = _FakeApt(debs, "1.0")
    monkeypatch.setattr(debian_packages.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(debian_packages.subprocess, "run", fake.run)
    monkeypatch.setattr(debian_packages, "_candidate_version", lambda package: fake.candidate)
    assert fetch_package("pkg", tmp_path) == (tmp_path / "pkgs" / "pkg", "1.0")  # first fetch
    fake.candidate, fake.download_works, fake.downloads = candidate, download_works, 0
    root, version = fetch_package("pkg", tmp_path)
    assert version == expected and (root / "text").read_text() == expected and fake.downloads == downloads
