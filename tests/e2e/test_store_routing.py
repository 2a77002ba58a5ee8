"""While the StoreActor holds the DuckDB file no other process can open it; ``raylens query`` then
runs on the actor, and the actor's ``sql`` stays read-only. One small StoreActor, no model."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone

import pyarrow as pa
import pytest

from engine.services.store_schema import ACTIVATION_SCHEMA


def rows(request_id: str) -> pa.Table:
    now = datetime.now(timezone.utc)
    return pa.table({
        "request_id": [request_id] * 3, "step": [1, 1, 2], "token_position": [4, 4, 5], "token_id": [9, 9, 10],
        "created_at": [now] * 3, "sae_release": ["s"] * 3, "sae_layer": [16] * 3, "feature_id": [7, 8, 7],
        "activation_value": [3.0, 1.0, 5.0], "rank": [0, 1, 0], "source_mode": ["inline"] * 3, "model_id": ["m"] * 3,
    }, schema=ACTIVATION_SCHEMA)


@pytest.fixture(scope="module")
def held_store(ray_head, tmp_path_factory):
    """A StoreActor holding a store, under the name the topology gives it, and a config naming both."""
    import dataclasses

    import ray

    from actors import StoreActor
    from engine.config import load_config
    from pipelines.cluster.actor_specs import STORE, actor_roles

    tmp = tmp_path_factory.mktemp("routing")
    cfg_path = tmp / "cfg.yaml"
    namespace = f"raylens-test-{uuid.uuid4().hex[:8]}"
    cfg_path.write_text(f"activations:\n  enabled: true\n  db_path: {tmp / 'store.duckdb'}\n"
                        f"ray:\n  address: {ray_head.address}\n  namespace: {namespace}\n  call_timeout_s: 60\n")
    cfg = load_config(cfg_path, env={})
    actor = StoreActor.options(name=actor_roles(cfg)[STORE], namespace=namespace, num_cpus=0.25).remote(
        dataclasses.asdict(cfg.activations))
    assert ray.get(actor.append.remote(rows("A"), "A/0", "A"), timeout=120) == 3
    yield cfg_path, cfg, actor
    ray.kill(actor, no_restart=True)


def test_a_query_goes_through_the_store_actor_while_it_holds_the_file(held_store, capsys):
    from engine.services.store import ActivationStore, StoreLockedError
    from pipelines.cli import main

    cfg_path, cfg, _ = held_store
    with pytest.raises(StoreLockedError):  # why the query must go through the actor
        ActivationStore.from_config(cfg.activations, read_only=True)
    assert main(["query", "top", "--request-id", "A", "--order", "activation", "--json", "--config",
                 str(cfg_path)]) == 0
    top = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["feature_id"], r["max_activation"]) for r in top] == [(7, 5.0), (8, 1.0)]
    # an argument the query refuses is still a one-line error, raised in the actor
    assert main(["query", "threshold", "--feature", "7", "--min", "nan", "--config", str(cfg_path)]) == 2
    assert capsys.readouterr().err.strip().startswith("raylens: error: `min` must be a finite number")


def _query_in_a_shell(cfg_path, env_var: str | None):
    """``raylens query top`` as a user runs it: a process of its own, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
    as given (None: unset; the tests' own process sets it), bounded far below the 10 minutes it
    used to hang."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env["PYTHONPATH"] = str(repo)
    if env_var is not None:
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = env_var
    return subprocess.run([sys.executable, "-m", "pipelines.cli", "query", "top", "--request-id", "A", "--order",
                           "activation", "--json",
                           "--config", str(cfg_path)], env=env, cwd=repo, capture_output=True, text=True, timeout=180)


def test_a_query_joins_a_loopback_cluster_without_any_environment_variable(held_store):
    cfg_path, _, _ = held_store
    done = _query_in_a_shell(cfg_path, None)
    assert done.returncode == 0, done.stderr[-2000:]
    top = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["feature_id"], r["max_activation"]) for r in top] == [(7, 5.0), (8, 1.0)]


def test_a_query_whose_ray_would_dial_a_loopback_cluster_elsewhere_is_one_line_not_a_hang(held_store):
    """With the variable set to 1 Ray dials 127.0.0.1 at this machine's outward address, where the
    loopback head does not answer: one line naming the variable, exit 2 (it used to hang)."""
    cfg_path, _, _ = held_store
    done = _query_in_a_shell(cfg_path, "1")
    if done.returncode == 0:  # this machine's outward address reaches the head: nothing to refuse
        pytest.skip("the head answers at this machine's outward address too")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("raylens: error: ") and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in last, done.stderr[-2000:]


def test_the_store_actors_sql_refuses_writes(held_store):
    import ray
    from ray.exceptions import RayTaskError

    _, _, actor = held_store
    with pytest.raises(RayTaskError, match="must be exactly one read-only SELECT"):
        ray.get(actor.sql.remote("DELETE FROM activations"), timeout=60)
    cte = "WITH d AS (DELETE FROM activations RETURNING *) SELECT count(*) FROM d"
    assert ray.get(actor.sql.remote(cte), timeout=60) == [(3,)]
    assert ray.get(actor.sql.remote("SELECT count(*) FROM activations"), timeout=60) == [(3,)]  # rolled back
