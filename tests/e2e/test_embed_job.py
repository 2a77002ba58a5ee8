"""The embedding job on a real local Ray cluster bound to 127.0.0.1: a texts file in, Parquet out,
equal to the in-process engine's embeddings, and the job's actor gone afterwards.

The cluster is this module's own: ``ray.init`` starts it and ``ray.shutdown`` stops exactly it,
leaving any other Ray on the machine alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(900)

TEXTS = ["n : Nat\n⊢ n + 0 = n", "a b : Nat\n⊢ a + b = b + a", "The sky is blue.", "hello", "xs : List Nat"]
# Same model and batches, but another process with another thread count: float32 sums may be
# reduced in another order, so the bound is relative to the embeddings' scale (float32 eps ~1.2e-7
# times the depth of the model's reductions), never an absolute 1e-5.
RAY_EQUALS_IN_PROCESS_RTOL = 1e-4


@pytest.fixture(scope="module")
def ray_head():
    import ray

    from tests.e2e.conftest import Head

    # address="local": always a new instance, never one a `ray start` elsewhere on the machine left running
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        gcs = ray.get_runtime_context().gcs_address
        assert gcs.startswith("127.0.0.1:"), f"Ray must stay on loopback in tests, but its GCS is at {gcs}"
        yield Head(gcs, "", None)
    finally:
        ray.shutdown()


def test_embed_job_writes_parquet_equal_to_the_engine(ray_head, engine, tmp_path, capsys):
    import pyarrow.parquet as pq
    import ray

    from pipelines.jobs.embed import main
    from tests.e2e.conftest import wait_until

    (tmp_path / "states.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TEXTS), encoding="utf-8")
    code = main(["--config", str(REPO / "configs" / "local.yaml"), "--texts-file", "states.jsonl",
                 "--out", "emb.parquet", "--workdir", str(tmp_path), "--chunk-size", "2", "--pool", "last",
                 "--address", ray_head.address])
    assert code == 0, capsys.readouterr().err
    table = pq.read_table(tmp_path / "emb.parquet")
    assert table.column("line").to_pylist() == list(range(1, len(TEXTS) + 1))
    assert table.column("text").to_pylist() == TEXTS
    meta = table.schema.metadata
    assert meta[b"raylens.pool"] == b"last" and meta[b"raylens.layer"] == b"final_norm"
    got = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    expected = engine.embed(TEXTS, pool="last")
    scale = float(np.abs(expected).max())
    worst = float(np.abs(got - expected).max()) / scale
    assert worst < RAY_EQUALS_IN_PROCESS_RTOL, (
        f"the Ray job's embeddings differ from in-process by {worst:.3g} of their scale {scale:.3g} "
        f"(bound {RAY_EQUALS_IN_PROCESS_RTOL}); look at pipelines' embed job and engine.model.embeddings")
    # positive control: another pooling is far outside the bound, so the comparison can fail
    assert float(np.abs(engine.embed(TEXTS, pool="mean") - expected).max()) / scale > 100 * RAY_EQUALS_IN_PROCESS_RTOL
    total = ray.cluster_resources()["CPU"]
    wait_until(lambda: ray.available_resources().get("CPU") == total, timeout=60,
               what="the job's EmbedActor to be killed and its CPU released")


def test_embed_job_refuses_a_bad_layer_before_embedding(ray_head, tmp_path, capsys):
    from pipelines.jobs.embed import main

    (tmp_path / "t.txt").write_text("hello\n", encoding="utf-8")
    code = main(["--config", str(REPO / "configs" / "local.yaml"), "--texts-file", "t.txt", "--out", "e.parquet",
                 "--workdir", str(tmp_path), "--layer", "10000", "--address", ray_head.address])
    assert code == 2 and "`layer` must be in [0," in capsys.readouterr().err
    assert not (tmp_path / "e.parquet").exists()
