"""The OpenAI routes' pure helpers: interleaving choice streams, the legacy log-probs object, and
the fields refused rather than ignored."""

from __future__ import annotations

import asyncio

import pytest


def test_interleave_yields_every_item_in_each_sources_order_and_raises_a_sources_error():
    from pipelines.serve.openai_choices import interleave

    async def source(name, n, fail=False):
        for i in range(n):
            await asyncio.sleep(0)
            yield f"{name}{i}"
        if fail:
            raise ValueError(f"{name} failed")

    async def collect(sources):
        return [item async for item in interleave(sources)]

    items = asyncio.run(collect([source("a", 3), source("b", 2)]))
    assert sorted(items) == ["a0", "a1", "a2", "b0", "b1"]
    assert [i for i in items if i[0] == "a"] == ["a0", "a1", "a2"]  # each source keeps its order
    assert asyncio.run(collect([source("x", 2)])) == ["x0", "x1"]
    with pytest.raises(ValueError, match="b failed"):
        asyncio.run(collect([source("a", 50), source("b", 1, fail=True)]))


def test_legacy_logprobs_offsets_follow_the_pieces_and_keep_the_best_of_a_shared_text():
    from pipelines.serve.openai_legacy import LegacyLogprobs

    texts = {1: "x", 2: "y", 3: "x"}
    lp = LegacyLogprobs(lambda ids: texts[ids[0]], k=2, offset=4)
    lp.add("ab", None, None)
    lp.add("c", -0.5, ((1, -0.1), (3, -0.2), (2, -3.0)))
    assert lp.body() == {"tokens": ["ab", "c"], "token_logprobs": [None, -0.5], "top_logprobs": [None, {"x": -0.1}],
                         "text_offset": [4, 6]}
    assert lp.offset == 7


@pytest.mark.parametrize("extra, param", [
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_unsupported_fields_are_refused_naming_them(extra, param):
    from pipelines.serve.errors import ApiError
    from pipelines.serve.openai_common import refuse_unsupported

    with pytest.raises(ApiError) as err:
        refuse_unsupported(extra)
    assert err.value.parameter == param and err.value.status == 400
    refuse_unsupported({"modalities": ["text"], "user": "u", "audio": None})  # control: nothing refused


def test_stops_are_at_most_four_non_empty_strings():
    from pipelines.serve.errors import ApiError
    from pipelines.serve.openai_common import parse_stops

    assert parse_stops("\n") == ["\n"] and parse_stops(None) == [] and parse_stops(["a", "b"]) == ["a", "b"]
    for bad in (["a"] * 5, [""], "",):
        with pytest.raises(ApiError):
            parse_stops(bad)
