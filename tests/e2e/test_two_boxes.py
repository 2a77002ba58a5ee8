"""Two boxes on one machine: a head node and a second node that alone offers the SAE resource.

``ray.cluster_utils.Cluster`` starts two real raylets on loopback. SAE workers ask for the
``sae_gpu`` resource, so they must land on the second node; the rows they encode still land in
the single store on the head.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.e2e.conftest import kill_namespace_actors, ray_config

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    sae_box = cluster.add_node(num_cpus=3, resources={"sae_gpu": 2}, node_ip_address="127.0.0.1")
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes(timeout=120)
        yield cluster, sae_box
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_sae_workers_run_on_the_second_box_and_rows_land_in_the_one_store(two_nodes, tmp_path):
    import ray

    from pipelines.cluster.topology import build_topology
    from pipelines.jobs.generate import read_prompts, run

    cluster, sae_box = two_nodes
    config = ray_config(tmp_path, sae_worker_resource="sae_gpu")
    config = dataclasses.replace(config, ray=dataclasses.replace(config.ray, sae_workers=2))
    try:
        topo = build_topology(config)
        worker_nodes = {ray.get(w.node_id.remote(), timeout=300) for w in topo.sae_workers}
        assert worker_nodes == {sae_box.node_id}, "SAE workers must run only where sae_gpu is offered"
        prompts = tmp_path / "p.jsonl"
        prompts.write_text(json.dumps({"prompt": "Tell me about dragons", "max_tokens": 12, "temperature": 0,
                                       "request_id": "two-box"}) + "\n")
        summary = run(config, read_prompts(prompts), tmp_path / "r.jsonl", progress=lambda line: None)
        assert summary["sae_rows"] > 0 and summary["sae_blocks_missing"] == 0
        rows = ray.get(topo.store.sql.remote("SELECT count(*) FROM activations WHERE request_id = 'two-box'"),
                       timeout=120)
        assert rows == [(summary["sae_rows"],)]
    finally:
        kill_namespace_actors(config)
