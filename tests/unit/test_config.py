"""Config loading: YAML sections, env overrides (one table), validation with clear messages."""

from __future__ import annotations

import pytest

from engine.config import ENV_VARS, load_config, parse_bool
from engine.errors import ConfigError
from tests.helpers import REPO

LOCAL = REPO / "configs" / "local.yaml"


def test_local_config_names_the_embedded_model_on_cpu():
    cfg = load_config(LOCAL, env={})
    assert cfg.backend.model_id == "embedded:smollm2-135m-instruct"
    assert cfg.backend.device == "cpu" and cfg.backend.hidden_state_layer == 16
    assert cfg.backend.extract_attention and cfg.backend.extract_hidden_states


def test_production_config_names_llama():
    cfg = load_config(REPO / "configs" / "llama31-8b.yaml", env={})
    assert cfg.backend.model_id == "meta-llama/Llama-3.1-8B-Instruct" and cfg.backend.device == "auto"


def test_env_overrides_and_legacy_model_id_precedence():
    cfg = load_config(LOCAL, env={"MODEL_ID": "legacy/model", "CONCORDANCE_DEVICE": "auto",
                                  "CONCORDANCE_HIDDEN_LAYER": "3", "HF_TOKEN": "secret",
                                  "QUOTE_LOG_INGEST_URL": "http://127.0.0.1:9/v1/ingest"})
    assert cfg.backend.model_id == "legacy/model" and cfg.backend.device == "auto"
    assert cfg.backend.hidden_state_layer == 3 and cfg.ingest.url == "http://127.0.0.1:9/v1/ingest"
    assert "secret" not in repr(cfg.backend)  # secrets stay out of reprs and logs
    both = load_config(LOCAL, env={"MODEL_ID": "legacy/model", "CONCORDANCE_MODEL": "new/model"})
    assert both.backend.model_id == "new/model"


def test_every_env_var_targets_a_real_field():
    import dataclasses

    from engine.config import RaylensConfig

    sections = {f.name: f.default_factory() for f in dataclasses.fields(RaylensConfig) if f.name != "source"}
    for var in ENV_VARS:
        section, key = var.target.split(".")
        assert hasattr(sections[section], key), var


def test_a_bare_off_in_yaml_is_the_mode_named_off(tmp_path):
    """YAML 1.1 reads a bare ``off`` as false: for a setting whose modes include ``off`` it means
    that mode, not a type error; a bare ``on`` where no mode is so named is still refused."""
    path = tmp_path / "c.yaml"
    path.write_text("backend:\n  graph_decode: off\n  weight_prepack: off\n  paged_attention: off\n")
    backend = load_config(path, env={}).backend
    assert (backend.graph_decode, backend.weight_prepack, backend.paged_attention) == ("off", "off", "off")
    path.write_text("backend:\n  weight_prepack: on\n")
    with pytest.raises(ConfigError, match="`backend.weight_prepack` must be one of .*auto.*off.*got True"):
        load_config(path, env={})


def test_unknown_keys_are_errors_that_list_the_known_ones(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backend:\n  modle_id: x\n")
    with pytest.raises(ConfigError, match="unknown key.*backend.modle_id.*known keys of `backend`: backend_type"):
        load_config(path, env={})
    path.write_text("backnd: {}\n")
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(path, env={})


@pytest.mark.parametrize("yaml_text,message", [
    ("backend:\n  device: tpu\n", "`device` must be one of auto, cpu, mps, cuda"),
    ("backend:\n  dtype: float8\n", "`backend.dtype` must be one of auto, float32, float16, bfloat16, got 'float8'"),
    ("backend:\n  hidden_state_layer: -1\n", "`hidden_state_layer` must be >= 0"),
    ("backend:\n  hidden_state_layer: sixteen\n", "`backend.hidden_state_layer` must be an integer, got 'sixteen'"),
    ("generation:\n  max_tokens: 0\n", "`max_tokens` must be >= 1, got 0"),
    ("generation:\n  top_p: 1.5\n", "`top_p` must be in \\(0, 1\\]"),
    ("generation:\n  temperature: -1\n", "`temperature` must be >= 0"),
    ("ingest:\n  url: localhost:6767\n", "must start with http"),
])
def test_bad_values_are_rejected_with_the_constraint(tmp_path, yaml_text, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, env={})


def test_missing_file_and_bad_env_values_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; pass --config"):
        load_config(tmp_path / "nope.yaml", env={})
    with pytest.raises(ConfigError, match="CONCORDANCE_HIDDEN_LAYER"):
        load_config(LOCAL, env={"CONCORDANCE_HIDDEN_LAYER": "deep"})


def test_parse_bool_is_the_one_bool_parser():
    assert parse_bool("1") and parse_bool("true") and parse_bool("YES")
    assert not parse_bool("0") and not parse_bool("false") and not parse_bool("")
    with pytest.raises(ValueError):
        parse_bool("maybe")


def test_ray_commands_turn_on_token_auth_when_a_token_exists(tmp_path, monkeypatch):
    from pipelines.cli.ray_commands import prepare_ray_env

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    prepare_ray_env()
    assert "RAY_AUTH_MODE" not in __import__("os").environ  # no token, nothing to do
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 64)
    prepare_ray_env()
    assert __import__("os").environ["RAY_AUTH_MODE"] == "token"


def test_ray_commands_keep_a_loopback_cluster_on_loopback_and_leave_others_and_the_users_choice(monkeypatch):
    import os

    from pipelines.cli.ray_commands import prepare_ray_env

    var = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for address, expected in (("10.1.2.3:6379", None), ("auto", None), ("127.0.0.1:6379", "0"), ("localhost:1", "0")):
        monkeypatch.delenv(var, raising=False)
        prepare_ray_env(address=address)
        assert os.environ.get(var) == expected, address
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # Ray reads RAY_ADDRESS first: so does this
    monkeypatch.delenv(var, raising=False)
    prepare_ray_env(address="auto")
    assert os.environ.get(var) == "0"
    monkeypatch.setenv(var, "1")  # the user's own setting is kept
    prepare_ray_env(address="127.0.0.1:6379")
    assert os.environ[var] == "1"
