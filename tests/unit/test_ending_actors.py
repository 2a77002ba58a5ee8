"""Whoever ends named actors (``raylens scale``, ``raylens stop``, get-or-create replacing an actor
that runs other code) goes on only once Ray no longer lists them.

``ray.kill`` only asks the cluster to end an actor; on a busy head its name stays listed for a
moment. The e2e tests (tests/e2e/test_replicas_routing.py, test_jobs_and_replicas.py) run the real
thing; these pin the order of the steps with a stand-in for the few Ray calls they make.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.helpers import build_config


class _Method:
    def __init__(self, actor: "_Replica", name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self) -> tuple[str, "_Replica"]:
        return self.name, self.actor


class _Replica:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.in_flight = 2  # finishes one request per look

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)


class _FakeRay:
    """The named-actor table, with a kill that takes ``listed_after_kill`` more looks to show."""

    def __init__(self, names: list[str], listed_after_kill: int) -> None:
        self.alive = {name: _Replica() for name in names}
        self.dying: dict[str, int] = {}
        self.listed_after_kill = listed_after_kill
        self.util = self

    def list_named_actors(self, all_namespaces: bool = False) -> list[dict[str, str]]:
        for name in list(self.dying):
            self.dying[name] -= 1
            if self.dying[name] < 0:
                del self.dying[name], self.alive[name]
        return [{"name": name, "namespace": "raylens"} for name in self.alive]

    def get_actor(self, name: str, namespace: str) -> _Replica:
        if name not in self.alive:
            raise ValueError(f"no actor {name}")
        return self.alive[name]

    def get(self, call: tuple[str, _Replica], timeout: float) -> Any:
        method, actor = call
        actor.calls.append(method)
        if method == "stats":
            actor.in_flight = max(0, actor.in_flight - 1)
            return {"in_flight": actor.in_flight}
        if method == "version":
            return "code of an older release"
        return None

    def kill(self, actor: _Replica, no_restart: bool) -> None:
        assert no_restart
        name = next(n for n, a in self.alive.items() if a is actor)
        self.dying[name] = self.listed_after_kill


@pytest.fixture
def config():
    cfg = build_config()
    return dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, namespace="raylens", call_timeout_s=5.0))


def test_scale_down_drains_then_ends_and_reports_the_replica_gone_once_ray_no_longer_lists_it(config, monkeypatch):
    from pipelines.cluster import ending, scaling
    from pipelines.cluster.actor_specs import generator_prefix

    prefix = generator_prefix(config)
    fake = _FakeRay([f"{prefix}0", f"{prefix}1", f"{prefix}2"], listed_after_kill=3)
    removed = [fake.alive[f"{prefix}1"], fake.alive[f"{prefix}2"]]
    monkeypatch.setattr(scaling, "ray", fake)
    monkeypatch.setattr(ending, "ray", fake)
    monkeypatch.setattr(scaling.time, "sleep", lambda _: None)

    report = scaling.scale(config, 1)

    assert report == {"replicas": [0], "added": [], "removed": [2, 1], "still_draining": []}
    for replica in removed:  # refuses new requests, waits for its running ones, settles; then it is ended
        assert replica.calls == ["start_draining", "stats", "stats", "drain"]
    assert list(fake.alive) == [f"{prefix}0"] and fake.alive[f"{prefix}0"].calls == []


def test_a_replica_still_running_requests_at_the_deadline_is_left_draining_not_cut_off(config, monkeypatch):
    from pipelines.cluster import ending, scaling
    from pipelines.cluster.actor_specs import generator_prefix

    prefix = generator_prefix(config)
    fake = _FakeRay([f"{prefix}0", f"{prefix}1"], listed_after_kill=0)
    busy = fake.alive[f"{prefix}1"]
    busy.in_flight = 10**9
    clock = iter(range(0, 10**6, 1))
    monkeypatch.setattr(scaling, "ray", fake)
    monkeypatch.setattr(ending, "ray", fake)
    monkeypatch.setattr(scaling.time, "sleep", lambda _: None)
    monkeypatch.setattr(scaling.time, "monotonic", lambda: float(next(clock)))

    report = scaling.scale(config, 1)

    assert report == {"replicas": [0, 1], "added": [], "removed": [], "still_draining": [1]}
    assert busy.calls[0] == "start_draining" and "drain" not in busy.calls


def test_ending_actors_returns_the_names_ray_still_lists_at_the_deadline(monkeypatch):
    """What `raylens stop` reports (and exits 1 on) when a kill has not taken effect in time."""
    from pipelines.cluster import ending

    fake = _FakeRay(["raylens-store-a", "raylens-ingest-b", "raylens-generator-c-0"], listed_after_kill=10**9)
    clock = iter(range(0, 10**6, 1))
    monkeypatch.setattr(ending, "ray", fake)
    monkeypatch.setattr(ending.time, "sleep", lambda _: None)
    monkeypatch.setattr(ending.time, "monotonic", lambda: float(next(clock)))

    left = ending.end_named_actors("raylens", ["raylens-store-a", "raylens-gone"], timeout_s=5)

    assert left == ["raylens-store-a"]  # an unknown name was "ended meanwhile"; the other was never asked to end
    assert "raylens-ingest-b" in ending.listed_names("raylens") and "raylens-ingest-b" not in fake.dying
    fake.listed_after_kill = 0
    assert ending.end_named_actors("raylens", ["raylens-ingest-b"], timeout_s=5) == []


def test_an_actor_running_other_code_is_replaced_only_once_its_name_is_free(config, monkeypatch):
    """While Ray still lists the old actor's name, get-or-create would hand the old actor back."""
    from pipelines.cluster import ending, topology

    fake = _FakeRay(["raylens-store-a"], listed_after_kill=3)
    old = fake.alive["raylens-store-a"]
    monkeypatch.setattr(topology, "ray", fake)
    monkeypatch.setattr(ending, "ray", fake)
    monkeypatch.setattr(ending.time, "sleep", lambda _: None)
    created = []

    class Store:
        @staticmethod
        def options(**options):
            created.append((options["name"], options["get_if_exists"], "raylens-store-a" in fake.alive))
            return type("Created", (), {"remote": staticmethod(lambda *args: "the new actor")})

    assert topology._get_or_create(Store, "raylens-store-a", config, {}) == "the new actor"
    assert old.calls == ["version"] and created == [("raylens-store-a", True, False)]


def test_raylens_stop_reports_the_actors_ray_still_lists_and_exits_1(config, tmp_path, monkeypatch, capsys):
    import json

    import yaml

    from pipelines.cli import main, ray_commands
    from pipelines.cluster import connection, ending
    from pipelines.cluster.actor_specs import actor_names

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    names = actor_names(config)
    fake = _FakeRay([*names, "raylens-store-of-another-config"], listed_after_kill=10**9)
    clock = iter(range(0, 10**6, 1))
    monkeypatch.setattr(ray_commands, "prepare_ray_env", lambda *_: None)
    monkeypatch.setattr(connection, "connect", lambda *_: None)
    monkeypatch.setattr(ending, "ray", fake)
    monkeypatch.setattr(ending.time, "sleep", lambda _: None)
    monkeypatch.setattr(ending.time, "monotonic", lambda: float(next(clock)))

    assert main(["stop", "--config", str(path)]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {"namespace": "raylens", "stopped": [], "still_listed": sorted(names)}
    assert "run `raylens stop` again" in err and "Traceback" not in err
    assert set(fake.dying) == set(names)  # this config's actors only: the other config's was left alone

    fake.listed_after_kill = 0
    assert main(["stop", "--config", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["still_listed"] == []
    assert ending.listed_names("raylens") == {"raylens-store-of-another-config"}
