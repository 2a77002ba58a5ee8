"""Actors are keyed by the config parts they hold: another store, ingest, SAE or resources means
other actors; settings that shape no actor keep the same ones."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import build_config


def changed(config, section: str, **values):
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)})


@pytest.fixture
def config():
    cfg = build_config()
    return changed(changed(cfg, "activations", enabled=True), "sae", enabled=True)


@pytest.mark.parametrize(("section", "values", "roles"), [
    ("activations", {"db_path": "/elsewhere/other.duckdb"}, {"raylens-store", "raylens-sae-0", "raylens-generator"}),
    ("ingest", {"url": "http://127.0.0.1:1/v1/ingest"}, {"raylens-ingest", "raylens-generator"}),
    ("sae", {"top_k": 7}, {"raylens-sae-0", "raylens-generator"}),
    ("ray", {"generator_num_cpus": 2.0}, {"raylens-generator"}),
    ("ray", {"store_num_cpus": 1.0}, {"raylens-store", "raylens-sae-0", "raylens-generator"}),
])
def test_a_config_that_differs_in_what_an_actor_holds_names_other_actors(config, section, values, roles):
    from pipelines.cluster.actor_specs import actor_roles

    before, after = actor_roles(config), actor_roles(changed(config, section, **values))
    differ = {role for role in before if before[role] != after.get(role)}
    assert roles <= differ, (section, values, differ)
    if section != "ingest":
        assert before["raylens-ingest"] == after["raylens-ingest"]  # positive control: the rest is shared


def test_settings_that_shape_no_actor_keep_the_same_names(config):
    from pipelines.cluster.actor_specs import actor_roles

    same = changed(config, "ray", namespace="other", actor_start_timeout_s=5.0, connect_timeout_s=1.0)
    assert actor_roles(same) == actor_roles(config)


def test_generator_replicas_have_distinct_names_and_each_asks_for_its_resources(config):
    from pipelines.cluster.actor_specs import actor_roles, actor_specs, check_capacity, generator_name

    scaled = changed(config, "ray", generators=3, generator_num_cpus=1.0)
    roles = actor_roles(scaled)
    replicas = [roles[r] for r in ("raylens-generator", "raylens-generator-1", "raylens-generator-2")]
    assert replicas == [generator_name(scaled, i) for i in range(3)] and len(set(replicas)) == 3
    assert replicas[0] == actor_roles(config)["raylens-generator"]  # scaling out keeps the first replica
    generators = [s for s in actor_specs(scaled) if s.name.startswith("raylens-generator")]
    assert [s.actor for s in generators] == replicas and all(s.resources["CPU"] == 1.0 for s in generators)
    from engine.errors import ClusterCapacityError

    with pytest.raises(ClusterCapacityError, match=r"ray.generator_num_cpus 3"):
        check_capacity(actor_specs(scaled), [{"CPU": 3.0}])


def test_generators_must_be_at_least_one():
    from engine.config import load_config
    from engine.errors import ConfigError
    from tests.helpers import REPO

    with pytest.raises(ConfigError, match=r"`ray.generators` must be >= 1, got 0"):
        load_config(REPO / "configs" / "local.yaml", env={}, overrides={"ray": {"generators": 0}})


def test_a_config_read_back_from_yaml_keys_the_same_actors(config, tmp_path):
    """A job reads its config from a file: `120` there and `120.0` here are one setting."""
    import yaml

    from engine.config import load_config
    from pipelines.cluster.actor_specs import actor_roles

    config = changed(config, "ray", call_timeout_s=120)  # an int in a float field, as dataclasses.replace allows
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config.to_dict()))
    assert actor_roles(load_config(tmp_path / "c.yaml", env={})) == actor_roles(config)
