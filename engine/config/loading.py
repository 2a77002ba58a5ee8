"""Where a config comes from: the YAML file, then the environment (the one table of variables,
:data:`ENV_VARS`, the only place raylens reads it), then explicit overrides."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from engine.errors import ConfigError

from .sections import SECTIONS, RaylensConfig, build_section

__all__ = ["EnvVar", "ENV_VARS", "parse_bool", "default_config_path", "load_config", "load_job_config"]


def parse_bool(text: str) -> bool:
    """The one bool parser for environment values."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false/1/0, got {text!r}")


def _optional_str(text: str) -> str | None:
    return text or None


@dataclass(frozen=True)
class EnvVar:
    name: str
    target: str  # "section.field"
    parse: Callable[[str], Any]
    doc: str


#: Every environment variable raylens reads. Later entries win over earlier ones for one field.
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("MODEL_ID", "backend.model_id", str, "legacy alias of CONCORDANCE_MODEL"),
    EnvVar("CONCORDANCE_MODEL", "backend.model_id", str,
           "model: a hub id, a local directory, or embedded:smollm2-135m-instruct"),
    EnvVar("CONCORDANCE_DEVICE", "backend.device", str, "auto | cpu | mps | cuda | cuda:N"),
    EnvVar("CONCORDANCE_HIDDEN_LAYER", "backend.hidden_state_layer", int,
           "layer whose hidden states and attention events carry"),
    EnvVar("RAYLENS_MODEL_CACHE", "backend.model_cache_dir", str,
           "directory for converted embedded models"),
    EnvVar("RAYLENS_COMPILE_CACHE", "backend.compile_cache_dir", str,
           "directory for compiled decode steps (graph_decode: compile)"),
    EnvVar("HF_TOKEN", "backend.hf_token", _optional_str, "HuggingFace token for gated hub models"),
    EnvVar("QUOTE_LOG_INGEST_URL", "ingest.url", _optional_str,
           "ingest endpoint (e.g. http://localhost:6767/v1/ingest); empty: do not send"),
    EnvVar("QUOTE_LOG_INGEST_TIMEOUT", "ingest.timeout_s", float, "seconds per ingest POST"),
    EnvVar("RAYLENS_INGEST_SPOOL", "ingest.spool_dir", str, "where unsent payloads wait"),
    EnvVar("CONCORDANCE_ACTIVATIONS_ENABLED", "activations.enabled", parse_bool, "write activation rows"),
    EnvVar("CONCORDANCE_ACTIVATIONS_DB_PATH", "activations.db_path", str, "the DuckDB file"),
    EnvVar("CONCORDANCE_ACTIVATIONS_PARQUET_PATH", "activations.parquet_path", str, "Parquet export directory"),
    EnvVar("CONCORDANCE_ACTIVATION_RETENTION_DAYS", "activations.retention_days", int, "days of rows kept"),
    EnvVar("CONCORDANCE_SAE_ENABLED", "sae.enabled", parse_bool, "extract SAE features"),
    EnvVar("CONCORDANCE_SAE_MODE", "sae.mode", str, "nearline | inline"),
    EnvVar("CONCORDANCE_SAE_ID", "sae.sae_id", str, "SAE registry name or sae-lens directory"),
    EnvVar("CONCORDANCE_SAE_LAYER", "sae.layer", int, "the SAE's layer"),
    EnvVar("CONCORDANCE_SAE_TOP_K", "sae.top_k", int, "features stored per token"),
    EnvVar("RAYLENS_RAY_ADDRESS", "ray.address", str, "Ray cluster address for jobs (default auto)"),
    EnvVar("RAYLENS_DASHBOARD_URL", "ray.dashboard_url", str, "Ray dashboard / Jobs API URL"),
)


def default_config_path() -> Path:
    """``RAYLENS_CONFIG`` if set, else ``configs/local.yaml`` of this checkout."""
    env = os.environ.get("RAYLENS_CONFIG")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file `{path}` does not exist; pass --config PATH or set RAYLENS_CONFIG",
                          parameter="config", value=str(path))
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file `{path}` is not valid YAML: {err}", parameter="config") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file `{path}` must hold a mapping of sections", parameter="config")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(unknown)} in `{path}`; known: {', '.join(SECTIONS)}",
                          parameter="config", value=unknown)
    return data


def load_job_config(config: str | None, workdir: str | None) -> tuple[Path, "RaylensConfig"]:
    """``(base, config)`` for a Ray Job: relative paths (the config file when it is not found as
    given, the store, the spool) are taken under ``workdir`` (default: the current directory),
    because a job runs in a throwaway copy of its working directory."""
    base = Path(workdir or ".").resolve()
    path = Path(config) if config else None
    if path is not None and not path.is_absolute() and not path.exists():
        path = base / path
    return base, load_config(path).with_paths_under(base)


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> RaylensConfig:
    """Load a config file (default: :func:`default_config_path`), then apply env and overrides."""
    env = os.environ if env is None else env
    config_path = Path(path) if path is not None else default_config_path()
    raw = _read_yaml(config_path)
    sections: dict[str, dict[str, Any]] = {name: dict(raw.get(name) or {}) for name in SECTIONS}
    for var in ENV_VARS:
        if var.name in env:
            section, key = var.target.split(".")
            try:
                sections[section][key] = var.parse(env[var.name])
            except ValueError as err:
                raise ConfigError(f"environment variable {var.name} ({var.doc}): {err}",
                                  parameter=var.name, value=env[var.name]) from None
    for section, values in (overrides or {}).items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {section!r}; known: {', '.join(SECTIONS)}")
        sections[section].update(values)
    built = {name: build_section(name, cls, sections[name]) for name, cls in SECTIONS.items()}
    return RaylensConfig(**built, source=str(config_path))
