"""The activation store's schema: Arrow row schema plus versioned, additive migrations.

Every migration only adds (tables, columns, indexes) and is recorded in ``schema_migrations``
when applied, so opening an older store upgrades it in place and nothing is ever rewritten or
dropped. The next phase's optional full hidden-state vectors will be one more entry here (a new
table keyed by request/step/position), not a change to ``activations``.

``activations``: one row per (token, feature) in a token's top-k SAE features.
``step`` is the step of the event whose forward pass computed the hidden state: prompt tokens
come from the prefill (step 0); a token committed at step ``s`` is read by the model, and so
encoded, at step ``s + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

__all__ = ["ACTIVATION_SCHEMA", "Migration", "MIGRATIONS", "LATEST_VERSION"]

ACTIVATION_SCHEMA = pa.schema([
    ("request_id", pa.string()),
    ("step", pa.int32()),
    ("token_position", pa.int32()),
    ("token_id", pa.int32()),
    ("created_at", pa.timestamp("us", tz="UTC")),
    ("sae_release", pa.string()),
    ("sae_layer", pa.int16()),
    ("feature_id", pa.int32()),
    ("activation_value", pa.float32()),
    ("rank", pa.int16()),
    ("source_mode", pa.string()),  # nearline | inline
    ("model_id", pa.string()),
])


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "activation rows, requests, write batches, missing blocks", (
        """CREATE TABLE activations (
            request_id VARCHAR NOT NULL,
            step INTEGER NOT NULL,
            token_position INTEGER NOT NULL,
            token_id INTEGER NOT NULL,
            created_at TIMESTAMPTZ NOT NULL,
            sae_release VARCHAR NOT NULL,
            sae_layer SMALLINT NOT NULL,
            feature_id INTEGER NOT NULL,
            activation_value REAL NOT NULL,
            rank SMALLINT NOT NULL,
            source_mode VARCHAR NOT NULL,
            model_id VARCHAR NOT NULL
        )""",
        """CREATE TABLE requests (
            request_id VARCHAR PRIMARY KEY,
            created_at TIMESTAMPTZ NOT NULL,
            model_id VARCHAR,
            prompt_text VARCHAR,
            output_text VARCHAR,
            prompt_ids INTEGER[],
            output_ids INTEGER[],
            finish_reason VARCHAR,
            config JSON
        )""",
        # one row per appended block: makes retried appends idempotent and shows what landed
        """CREATE TABLE write_batches (
            batch_id VARCHAR PRIMARY KEY,
            request_id VARCHAR NOT NULL,
            row_count INTEGER NOT NULL,
            written_at TIMESTAMPTZ NOT NULL
        )""",
        # blocks whose encoding failed for good, so a gap in the rows is explained, never silent
        """CREATE TABLE missing_blocks (
            batch_id VARCHAR PRIMARY KEY,
            request_id VARCHAR NOT NULL,
            first_step INTEGER,
            last_step INTEGER,
            token_count INTEGER,
            reason VARCHAR NOT NULL,
            recorded_at TIMESTAMPTZ NOT NULL
        )""",
    )),
    Migration(2, "feature metadata cache (Neuronpedia explanations)", (
        """CREATE TABLE feature_metadata (
            sae_release VARCHAR NOT NULL,
            sae_layer SMALLINT NOT NULL,
            feature_id INTEGER NOT NULL,
            source VARCHAR NOT NULL,
            explanation VARCHAR,
            fetched_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (sae_release, sae_layer, feature_id, source)
        )""",
    )),
    Migration(3, "ledger of blocks handed to SAE workers and not yet stored", (
        # a generator records each block it hands off; the append of that batch clears it, and a
        # generator that dies leaves its blocks here, to be turned into missing_blocks rows
        """CREATE TABLE expected_blocks (
            batch_id VARCHAR PRIMARY KEY,
            request_id VARCHAR NOT NULL,
            first_step INTEGER,
            last_step INTEGER,
            token_count INTEGER,
            expected_at TIMESTAMPTZ NOT NULL
        )""",
        # requests whose generator died: a block announced for them after the fact is missing at once
        """CREATE TABLE abandoned_requests (
            request_id VARCHAR PRIMARY KEY,
            reason VARCHAR NOT NULL,
            abandoned_at TIMESTAMPTZ NOT NULL
        )""",
    )),
    Migration(4, "request ids claimed by job runs", (
        # a job claims its request ids before running them; an id an earlier run used (here, or with
        # rows anywhere) is not reused, so stored rows never mix two runs' tokens under one id
        """CREATE TABLE request_claims (
            request_id VARCHAR PRIMARY KEY,
            run_id VARCHAR NOT NULL,
            claimed_at TIMESTAMPTZ NOT NULL
        )""",
    )),
)

LATEST_VERSION = MIGRATIONS[-1].version
