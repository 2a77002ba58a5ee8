"""JSON schemas raylens validates against (the ingest payload schema of the Concordance backend)."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

__all__ = ["ingest_payload_schema", "payload_validator"]


@lru_cache(maxsize=1)
def ingest_payload_schema() -> dict[str, Any]:
    return json.loads(resources.files(__package__).joinpath("ingest-payload.schema.json").read_text("utf-8"))


@lru_cache(maxsize=1)
def payload_validator() -> Any:
    """A jsonschema validator for ingest payloads (RFC 3339 ``date-time`` checked)."""
    import jsonschema

    schema = ingest_payload_schema()
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)
