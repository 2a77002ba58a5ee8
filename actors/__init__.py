"""Ray actors: thin wrappers over ``engine/`` that add placement, batching and fault handling.

GeneratorActor (model + mod loop) → SAEWorkerActor (nearline SAE encoding) → StoreActor (the one
DuckDB writer); IngestActor batches observability payloads. ``pipelines/cluster/topology.py`` creates
them; nothing here runs at import time.
"""

from .generator import GeneratorActor
from .ingest_actor import IngestActor
from .sae_worker import SAEWorkerActor
from .store_actor import StoreActor
from .versioning import code_version

__all__ = ["GeneratorActor", "SAEWorkerActor", "StoreActor", "IngestActor", "code_version"]
