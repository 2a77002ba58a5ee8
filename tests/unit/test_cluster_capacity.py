"""The capacity check that turns an unplaceable actor set into an immediate, actionable error
(Ray itself would leave such actors pending forever)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import load_config
from engine.errors import ClusterCapacityError
from pipelines.cluster.actor_specs import actor_keys, actor_roles, actor_specs, check_capacity
from tests.helpers import REPO, build_config


def with_ray(config, **ray):
    return dataclasses.replace(config, ray=dataclasses.replace(config.ray, **ray))


def with_sae(config, enabled=True):
    return dataclasses.replace(config, activations=dataclasses.replace(config.activations, enabled=enabled),
                               sae=dataclasses.replace(config.sae, enabled=enabled))


def test_the_local_config_fits_ray_start_head_on_a_two_core_machine():
    specs = actor_specs(with_sae(build_config()))
    assert {s.name for s in specs} >= {"raylens-store", "raylens-ingest", "raylens-generator", "raylens-sae-0"}
    check_capacity(specs, [{"CPU": 2.0, "memory": 1e10}])  # no error
    assert sum(s.resources.get("CPU", 0) for s in specs) <= 2.0


def test_sae_workers_ask_for_nothing_when_sae_is_off():
    names = {s.name for s in actor_specs(with_sae(build_config(), enabled=False))}
    assert not any(n.startswith("raylens-sae") for n in names)


def test_sae_workers_ask_for_nothing_when_the_generator_encodes_inline():
    """With ``sae.mode: inline`` the generator encodes every step itself: no worker is started
    (idle workers would hold CPUs or GPU shares), and nearline still gets its workers."""
    config = with_sae(build_config())
    inline = dataclasses.replace(config, sae=dataclasses.replace(config.sae, mode="inline"))
    assert any(s.name.startswith("raylens-sae") for s in actor_specs(config))
    assert not any(s.name.startswith("raylens-sae") for s in actor_specs(inline))
    assert not any(role.startswith("raylens-sae") for role in actor_roles(inline))
    assert actor_keys(inline)["raylens-generator"] != actor_keys(config)["raylens-generator"]


def test_asking_for_more_cpus_than_the_cluster_has_names_the_settings_to_lower():
    specs = actor_specs(with_ray(with_sae(build_config()), sae_worker_num_cpus=1.0, sae_workers=2))
    with pytest.raises(ClusterCapacityError) as err:
        check_capacity(specs, [{"CPU": 2.0}])
    message = str(err.value)
    assert "3.5 CPU in all" in message and "ray.sae_worker_num_cpus 2" in message and "offers 2" in message
    assert "add a node" in message


def test_an_actor_larger_than_every_node_is_refused_even_when_the_total_would_do():
    specs = actor_specs(with_ray(build_config(), generator_num_cpus=3.0))
    with pytest.raises(ClusterCapacityError, match=r"raylens-generator asks for 3 CPU \(ray.generator_num_cpus\) "
                                                   r"but the largest node offers 2"):
        check_capacity(specs, [{"CPU": 2.0}, {"CPU": 2.0}])


def test_a_gpu_generator_on_a_cpu_only_cluster_is_refused():
    specs = actor_specs(with_ray(build_config(), generator_num_gpus=1.0))
    with pytest.raises(ClusterCapacityError, match="ray.generator_num_gpus"):
        check_capacity(specs, [{"CPU": 16.0}])


def test_the_production_config_needs_the_second_box_and_says_how_to_start_it():
    config = load_config(REPO / "configs" / "llama31-8b.yaml", env={})
    specs = actor_specs(config)
    head = {"CPU": 16.0, "GPU": 1.0}
    with pytest.raises(ClusterCapacityError) as err:
        check_capacity(specs, [head])
    assert "'sae_gpu'" in str(err.value) and "--resources" in str(err.value)
    assert err.value.parameter == "ray.sae_worker_resource"
    check_capacity(specs, [head, {"CPU": 16.0, "GPU": 1.0, "sae_gpu": 4.0}])  # with the SAE box: fits
