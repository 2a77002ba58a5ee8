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


def test_every_source_names_a_package_and_a_licence():
    assert len({s.name for s in corpus.SOURCES}) == len(corpus.SOURCES)
    for source in corpus.SOURCES:
        assert source.package and source.licence and source.weight > 0 and source.kind in ("prose", "code")
