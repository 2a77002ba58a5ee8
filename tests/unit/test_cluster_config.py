"""ray_cluster.yaml agrees with the production config: the second box offers the resource that
SAE workers ask for, and only that box does."""

from __future__ import annotations

import re

import yaml

from engine.config import load_config
from tests.helpers import REPO


def test_the_second_box_offers_the_sae_resource_the_production_config_asks_for():
    cluster = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    assert cluster["provider"]["type"] == "local" and len(cluster["provider"]["worker_ips"]) == 1
    worker_start = " ".join(cluster["worker_start_ray_commands"])
    head_start = " ".join(cluster["head_start_ray_commands"])
    offered = re.search(r"--resources='(\{.*?\})'", worker_start)
    assert offered, "the worker must start with --resources"
    resource = load_config(REPO / "configs" / "llama31-8b.yaml", env={}).ray.sae_worker_resource
    assert resource and f'"{resource}"' in offered.group(1)
    assert "--resources" not in head_start  # SAE workers never land on the head
    assert "scripts/setup.sh" in " ".join(cluster["setup_commands"])
