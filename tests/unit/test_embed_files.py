"""Texts files in, embedding files out, for ``raylens embed`` and the embedding job (no model)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.errors import InvalidRequestError
from pipelines.jobs.embed import TextLine, read_texts, write_embeddings


def test_row_i_is_line_i_so_a_blank_line_before_a_text_is_refused_and_trailing_ones_are_ignored(tmp_path):
    path = tmp_path / "states.txt"
    path.write_text("first\nsecond ⊢ n = n\n\n  \n", encoding="utf-8")
    assert read_texts(path) == [TextLine(1, "first"), TextLine(2, "second ⊢ n = n")]
    path.write_text("first\n\n  \nsecond ⊢ n = n\n", encoding="utf-8")
    with pytest.raises(InvalidRequestError, match=r"states.txt:2: each line must be a text \(row 2 of the output is "
                                                  r"line 2\), got a blank line; remove it"):
        read_texts(path)


def test_a_texts_file_that_is_not_utf8_is_one_clear_error(tmp_path):
    path = tmp_path / "states.txt"
    path.write_bytes(b"caf\xe9\n")
    with pytest.raises(InvalidRequestError, match=r"`--texts-file` must be UTF-8 text, got byte 0xe9 at offset 3"):
        read_texts(path)


def test_jsonl_texts_carry_newlines(tmp_path):
    path = tmp_path / "states.jsonl"
    path.write_text(json.dumps("n : Nat\n⊢ n + 0 = n") + "\n" + json.dumps({"text": "b"}) + "\n", encoding="utf-8")
    assert [t.text for t in read_texts(path)] == ["n : Nat\n⊢ n + 0 = n", "b"]


@pytest.mark.parametrize("content,message", [
    ('"ok"\n{broken\n', "states.jsonl:2: each line must be valid JSON"),
    ('{"txt": "x"}\n', "states.jsonl:1: each line must be a JSON string or an object with a non-empty string"),
    ("\n\n", "must hold at least one text"),
])
def test_bad_texts_files_name_the_line(tmp_path, content, message):
    path = tmp_path / "states.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(InvalidRequestError) as info:
        read_texts(path)
    assert message in str(info.value)


def test_parquet_and_npy_round_trip(tmp_path):
    import pyarrow.parquet as pq

    lines = [TextLine(1, "a"), TextLine(3, "b")]
    vectors = np.arange(8, dtype=np.float32).reshape(2, 4) / 3
    write_embeddings(tmp_path / "e.parquet", lines, vectors, model_id="m", layer=5, pool="last")
    table = pq.read_table(tmp_path / "e.parquet")
    assert table.column("line").to_pylist() == [1, 3] and table.column("text").to_pylist() == ["a", "b"]
    assert np.array_equal(np.stack(table.column("embedding").to_numpy(zero_copy_only=False)), vectors)
    assert table.schema.metadata[b"raylens.layer"] == b"5" and table.schema.metadata[b"raylens.dim"] == b"4"
    write_embeddings(tmp_path / "e.npy", lines, vectors, model_id="m", layer=None, pool="mean")
    assert np.array_equal(np.load(tmp_path / "e.npy"), vectors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.npy", "e.parquet"], "no partial files left behind"


def test_unknown_output_suffix_is_refused(tmp_path):
    with pytest.raises(InvalidRequestError, match="`--out` must end in .parquet or .npy"):
        write_embeddings(tmp_path / "e.csv", [TextLine(1, "a")], np.zeros((1, 2), np.float32), model_id="m",
                         layer=None, pool="mean")
