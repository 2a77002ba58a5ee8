"""Configuration: YAML sections loaded into frozen dataclasses, then environment overrides.

Precedence, lowest first: dataclass defaults < YAML file < environment variables (the table
:data:`ENV_VARS`, the only place the environment is read) < explicit keyword overrides.

Unknown YAML keys are errors that list the known keys: a typo must not be silently ignored.
``device="auto"``/``dtype="auto"`` are resolved when a backend loads (:mod:`engine.model.devices`),
so commands that only read the store never import torch.

``checks`` holds the value rules sections and requests share, ``sections`` the dataclasses,
``loading`` the file and the environment.
"""

from __future__ import annotations

from .checks import (I32_MAX, MIN_TEMPERATURE, MOD_LOG_MAX_CHARS, MOD_LOG_MIN_CHARS, REQUEST_ID_MAX_CHARS, SEED_MAX,
                     DeviceName, DType, check_request_id, choice_seed)
from .loading import ENV_VARS, EnvVar, default_config_path, load_config, load_job_config, parse_bool
from .sections import (ActivationsConfig, BackendConfig, GenerationConfig, IngestConfig, RayConfig, RaylensConfig,
                       SAEConfig, StructuredConfig)

__all__ = [
    "BackendConfig",
    "GenerationConfig",
    "StructuredConfig",
    "IngestConfig",
    "ActivationsConfig",
    "SAEConfig",
    "RayConfig",
    "RaylensConfig",
    "EnvVar",
    "ENV_VARS",
    "load_config",
    "load_job_config",
    "default_config_path",
    "parse_bool",
    "check_request_id",
    "choice_seed",
    "I32_MAX",
    "SEED_MAX",
    "MIN_TEMPERATURE",
    "REQUEST_ID_MAX_CHARS",
    "MOD_LOG_MIN_CHARS",
    "MOD_LOG_MAX_CHARS",
    "DeviceName",
    "DType",
]
