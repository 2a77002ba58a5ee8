"""The Ray actor system on a real local head bound to 127.0.0.1: jobs, the SAE hand-off, and
faults — each bounded in time."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import free_port, kill_namespace_actors, ray_config, wait_until
from tests.helpers import TEST_MODS

pytestmark = pytest.mark.timeout(900)

PROMPTS = [
    {"prompt": "What is the capital of France?", "max_tokens": 12, "temperature": 0, "request_id": "fr"},
    {"prompt": "Name a primary colour.", "max_tokens": 12, "temperature": 0, "request_id": "colour",
     "mods": [str(TEST_MODS / "forward_pass" / "force_tokens.py")]},
    {"messages": [{"role": "user", "content": "Tell me about dragons"}], "max_tokens": 16, "temperature": 0,
     "request_id": "dragons"},
]


def write_prompts(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def attempt(fn):
    try:
        return fn()
    except Exception:
        return None


@pytest.fixture(scope="module")
def ingest_server(tmp_path_factory):
    from engine.services.ingest_server import IngestServer

    server = IngestServer(tmp_path_factory.mktemp("ingest") / "ingest.duckdb", port=0).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def topology(ray_head, ingest_server, tmp_path_factory):
    from pipelines.cluster.topology import build_topology

    config = ray_config(tmp_path_factory.mktemp("ray"), ingest_url=ingest_server.url)
    topo = build_topology(config)
    yield topo
    kill_namespace_actors(config)


def run_lines(config, tmp_path, rows, name="results"):
    from pipelines.jobs.generate import read_prompts, run

    prompts = tmp_path / f"{name}.prompts.jsonl"
    write_prompts(prompts, rows)
    out = tmp_path / f"{name}.jsonl"
    summary = run(config, read_prompts(prompts), out, progress=lambda line: None)
    return summary, [json.loads(line) for line in out.read_text().splitlines()]


def store_sql(topology, sql, params=None):
    import ray

    return ray.get(topology.store.sql.remote(sql, params or []), timeout=120)


def sae_stats(topology):
    import ray

    return ray.get(topology.generator.stats.remote(), timeout=120)["sae"]


def test_a_job_runs_through_generator_sae_workers_store_and_ingest(topology, ingest_server, tmp_path, engine):
    summary, results = run_lines(topology.config, tmp_path, PROMPTS)
    by_id = {r["request_id"]: r for r in results}
    assert set(by_id) == {"fr", "colour", "dragons"} and summary["failed"] == 0
    local = engine.generate("What is the capital of France?", max_tokens=12, temperature=0)
    assert by_id["fr"]["output_text"] == local.output_text  # the actor runs the same engine
    assert by_id["colour"]["output_text"].startswith(" [INJECTED]")  # a mod file, shipped as a payload
    assert summary["sae_rows"] > 0 and summary["sae_blocks_missing"] == 0
    per_request = dict(store_sql(topology, "SELECT request_id, count(*) FROM activations GROUP BY 1"))
    assert set(per_request) == {"fr", "colour", "dragons"}
    assert store_sql(topology, "SELECT count(*) FROM expected_blocks") == [(0,)]
    assert store_sql(topology, "SELECT count(*) FROM requests") == [(3,)]
    wait_until(lambda: {"fr", "colour", "dragons"} <= set(ingest_server._server.request_ids()),
               timeout=60, what="the ingest server to hold every payload")
    stats = sae_stats(topology)
    assert stats["blocks_stored"] == stats["blocks_submitted"] > 0 and stats["backlog"] == 0
    import ray

    batch = ray.get(topology.generator.stats.remote(), timeout=120)["batch"]
    assert batch["max_active"] >= 2, f"the job's lines never shared a step on the generator: {batch}"


def test_killing_an_sae_worker_mid_run_loses_and_duplicates_nothing(topology, tmp_path):
    import ray

    before = sae_stats(topology)
    killed = threading.Event()

    def kill_when_busy() -> None:
        wait_until(lambda: sae_stats(topology)["blocks_submitted"] >= before["blocks_submitted"] + 3,
                   timeout=300, interval=0.05, what="SAE blocks in flight")
        ray.kill(topology.sae_workers[0], no_restart=False)  # Ray restarts it; its calls in flight fail
        killed.set()

    killer = threading.Thread(target=kill_when_busy, daemon=True)
    killer.start()
    rows = [{"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 40, "temperature": 0,
             "ignore_eos": True, "request_id": "lighthouse"}]
    summary, _ = run_lines(topology.config, tmp_path, rows, "kill")
    killer.join(timeout=300)
    assert killed.is_set()
    after = sae_stats(topology)
    submitted = after["blocks_submitted"] - before["blocks_submitted"]
    assert summary["sae_blocks_missing"] == 0 and after["blocks_missing"] == before["blocks_missing"]
    batches = store_sql(topology, "SELECT count(*) FROM write_batches WHERE request_id = 'lighthouse'")
    assert batches == [(submitted,)]  # every block stored exactly once (batch ids are keys)
    total, distinct = store_sql(topology, "SELECT count(*), count(DISTINCT (step, token_position, rank)) "
                                          "FROM activations WHERE request_id = 'lighthouse'")[0]
    assert total == distinct > 0  # no row twice
    steps = store_sql(topology, "SELECT count(DISTINCT step) FROM activations WHERE request_id = 'lighthouse'")
    assert steps == [(40,)]  # the prefill (step 0) and steps 1..39: every token the model read


def test_a_restarted_store_actor_reopens_the_database_intact(topology):
    import ray

    counts = ray.get(topology.store.counts.remote(), timeout=60)
    assert counts["activations"] > 0
    ray.kill(topology.store, no_restart=False)
    again = wait_until(lambda: attempt(lambda: ray.get(topology.store.counts.remote(), timeout=30)),
                       timeout=180, what="the StoreActor to come back")
    assert again == counts


def _kill_generator_once_under_way(topology, *, blocks: int) -> threading.Thread:
    """A thread that kills the generator (Ray restarts it) once ``blocks`` more SAE blocks were
    handed off, i.e. while requests are under way; join it after the job."""
    import ray

    before = sae_stats(topology)["blocks_submitted"]

    def kill_generator() -> None:
        wait_until(lambda: (attempt(lambda: sae_stats(topology)["blocks_submitted"]) or 0) >= before + blocks,
                   timeout=300, interval=0.05, what="the requests to be under way")
        ray.kill(topology.generator, no_restart=False)

    killer = threading.Thread(target=kill_generator, daemon=True)
    killer.start()
    return killer


def test_a_dead_generator_leaves_missing_blocks_on_record_and_the_request_reruns(topology, tmp_path):
    killer = _kill_generator_once_under_way(topology, blocks=2)
    rows = [{"prompt": "Describe the sea at night.", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
             "request_id": "sea"}]
    summary, results = run_lines(topology.config, tmp_path, rows, "death")
    killer.join(timeout=300)
    assert [r["request_id"] for r in results] == ["sea-retry1"] and results[0]["finish_reason"] == "length"
    # every block of the dead attempt is accounted for: stored, or on record as missing — none pending
    assert store_sql(topology, "SELECT count(*) FROM expected_blocks WHERE request_id = 'sea'") == [(0,)]
    missing = store_sql(topology, "SELECT reason FROM missing_blocks WHERE request_id = 'sea'")
    assert all(reason.startswith("generator died") for reason, in missing)
    assert store_sql(topology, "SELECT count(*) FROM requests WHERE request_id = 'sea-retry1'") == [(1,)]


def test_a_generator_killed_mid_job_loses_no_line(topology, tmp_path):
    """Several lines in flight when the generator dies: the driver waits for the restarted one
    (it reloads its model) and every line is in the results file, finished, none lost."""
    killer = _kill_generator_once_under_way(topology, blocks=3)
    rows = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "request_id": f"many-{i}"}
            for i, p in enumerate(["Describe the sea.", "Describe a forest.", "Describe a city at dawn."])]
    summary, results = run_lines(topology.config, tmp_path, rows, "many")
    killer.join(timeout=300)
    assert sorted(r["line"] for r in results) == [1, 2, 3], results
    assert all(r["finish_reason"] == "length" for r in results), results
    assert any(r["request_id"].endswith("-retry1") for r in results), "positive control: the kill hit a line"
    assert summary["failed"] == 0 and summary["requests"] == 3


def test_bad_job_input_names_the_line(tmp_path, capsys):
    from pipelines.jobs.generate import main

    assert main(["--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "prompts file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "broken"\n')
    assert main(["--prompts", str(bad), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
    bad.write_text('{"prompt": "fine"}\n\n{"prompt": "x", "mods": ["no/such/mod.py"]}\n')
    assert main(["--prompts", str(bad), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3:" in err and "no/such/mod.py" in err and "does not exist" in err
    bad.write_text('{"prompt": "x", "temprature": 0}\n')
    assert main(["--prompts", str(bad), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "unknown field(s) temprature" in capsys.readouterr().err


def _job_config_file(config, tmp_path):
    path = tmp_path / "job-config.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    return path


def test_a_cancelled_job_leaves_the_actors_usable(ray_head, topology, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(ray_head.dashboard_url)
    prompts, out = tmp_path / "many.jsonl", tmp_path / "many-results.jsonl"
    write_prompts(prompts, [{"prompt": f"Count to {i}.", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
                            for i in range(12)])
    job = client.submit_job(entrypoint=f"{sys.executable} -m pipelines.jobs.generate --config "
                                       f"{_job_config_file(topology.config, tmp_path)} --prompts {prompts} --out {out}")
    wait_until(lambda: out.exists() and out.read_text().count("\n") >= 1, timeout=300, what="a first result")
    client.stop_job(job)
    wait_until(lambda: client.get_job_status(job) in (JobStatus.STOPPED, JobStatus.FAILED), timeout=120,
               what="the job to stop")
    summary, results = run_lines(topology.config, tmp_path, [PROMPTS[0] | {"request_id": "after-cancel"}], "after")
    assert results[0]["output_text"] and summary["failed"] == 0


def test_a_job_with_a_bad_line_fails_through_the_jobs_api_with_the_line_named(ray_head, topology, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(ray_head.dashboard_url)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"promt": "typo"}\n')
    job = client.submit_job(entrypoint=f"{sys.executable} -m pipelines.jobs.generate --config "
                                       f"{_job_config_file(topology.config, tmp_path)} --prompts {bad} "
                                       f"--out {tmp_path / 'x.jsonl'}")
    status = wait_until(lambda: (s := client.get_job_status(job)) in (JobStatus.SUCCEEDED, JobStatus.FAILED) and s,
                        timeout=180, what="the job to end")
    assert status == JobStatus.FAILED
    assert f"{bad}:2: unknown field(s) promt; known: prompt, messages, input_ids" in client.get_job_logs(job)


def test_payloads_are_spooled_while_ingest_is_down_then_delivered(ray_head, tmp_path):
    import ray

    from engine.services.ingest_server import IngestServer
    from pipelines.cluster.topology import build_topology

    port = free_port()
    config = ray_config(tmp_path, ingest_url=f"http://127.0.0.1:{port}/v1/ingest")
    config = dataclasses.replace(config, sae=dataclasses.replace(config.sae, enabled=False))
    topo = build_topology(config)
    server = None
    try:
        rows = [{"prompt": "Say hi.", "max_tokens": 4, "temperature": 0, "request_id": f"down-{i}"} for i in range(3)]
        summary, _ = run_lines(config, tmp_path, rows, "down")
        assert summary["ingest_spooled"] == 3 and summary["ingest_delivered"] == 0  # backend down: kept on disk
        server = IngestServer(tmp_path / "late.duckdb", port=port).start()  # the backend comes back
        wait_until(lambda: {"down-0", "down-1", "down-2"} <= set(server._server.request_ids()), timeout=120,
                   what="spooled payloads to be replayed")
        stats = wait_until(lambda: (s := ray.get(topo.ingest.stats.remote(), timeout=30))["spool_files"] == 0 and s,
                           timeout=60, what="the spool to empty")
        assert stats["replayed"] >= 3
    finally:
        kill_namespace_actors(config)
        if server is not None:
            server.stop()


def test_status_reports_actors_backlog_store_rows_and_spool(topology, tmp_path, capsys):
    from pipelines.cli import main

    run_lines(topology.config, tmp_path, [PROMPTS[0] | {"request_id": "for-status"}], "status")
    assert main(["status", "--config", str(_job_config_file(topology.config, tmp_path))]) == 0
    report = json.loads(capsys.readouterr().out)
    actors = report["actors"]
    assert isinstance(actors["raylens-store"], dict), report
    assert actors["raylens-store"]["activations"] > 0
    assert "backlog" in actors["raylens-generator"]["sae"]
    assert actors["raylens-ingest"]["spool_files"] == 0 and report["cluster"]["nodes"] == 1
    assert actors["raylens-ingest"]["rejected_files"] == 0
    rejected = Path(topology.config.ingest.spool_dir) / "rejected" / "given-up.json"  # as the client leaves one
    rejected.parent.mkdir(parents=True, exist_ok=True)
    rejected.write_text(json.dumps({"payload": {"request": {"request_id": "given-up"}}, "rejected_because": "500"}))
    try:
        assert main(["status", "--config", str(_job_config_file(topology.config, tmp_path))]) == 0
        assert json.loads(capsys.readouterr().out)["actors"]["raylens-ingest"]["rejected_files"] == 1
    finally:
        rejected.unlink()


def test_submit_runs_a_prompts_file_as_a_ray_job(ray_head, topology, tmp_path, capsys):
    from pipelines.cli import main

    prompts, out = tmp_path / "submit.jsonl", tmp_path / "submit-results.jsonl"
    write_prompts(prompts, [{"prompt": "Say hello.", "max_tokens": 6, "temperature": 0, "request_id": "submitted"}])
    code = main(["submit", "--prompts", str(prompts), "--out", str(out), "--address", ray_head.dashboard_url,
                 "--config", str(_job_config_file(topology.config, tmp_path)), "--timeout", "600"])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert "SUCCEEDED" in err and '"summary"' in err  # the job's own log, followed live
    assert json.loads(out.read_text().splitlines()[0])["request_id"] == "submitted"


def test_when_sae_workers_fall_behind_the_generator_waits_and_nothing_is_lost(ray_head, tmp_path):
    """One SAE worker, one block in flight at most, a block per forward pass: the hand-off must
    wait for the worker again and again (back-pressure) and still store every block."""
    import ray

    from pipelines.cluster.topology import build_topology

    config = ray_config(tmp_path, sae_workers=1, max_inflight_blocks=1)
    config = dataclasses.replace(config, sae=dataclasses.replace(config.sae, block_steps=1))
    try:
        topo = build_topology(config)
        summary, _ = run_lines(config, tmp_path, [{"prompt": "Count to ten.", "max_tokens": 16, "temperature": 0,
                                                   "ignore_eos": True, "request_id": "slow"}], "slow")
        stats = ray.get(topo.generator.stats.remote(), timeout=120)["sae"]
        assert stats["backlog_waits"] > 0 and stats["max_backlog"] == 1
        assert stats["blocks_stored"] == stats["blocks_submitted"] and summary["sae_blocks_missing"] == 0
    finally:
        kill_namespace_actors(config)


def _no_actor_named(name, namespace) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return True
    return False


def test_a_config_the_cluster_cannot_hold_fails_at_once_and_creates_nothing(ray_head, tmp_path):
    from engine.errors import ClusterCapacityError
    from pipelines.cluster.actor_specs import actor_names
    from pipelines.cluster.topology import build_topology

    config = ray_config(tmp_path, generator_num_cpus=64)
    with pytest.raises(ClusterCapacityError, match=r"raylens-generator asks for 64 CPU"):
        build_topology(config)
    assert all(_no_actor_named(name, config.ray.namespace) for name in actor_names(config))

    config = ray_config(tmp_path, sae_worker_resource="sae_gpu")
    with pytest.raises(ClusterCapacityError, match=r"no node offers the resource 'sae_gpu'"):
        build_topology(config)
    assert all(_no_actor_named(name, config.ray.namespace) for name in actor_names(config))


def test_actors_that_cannot_be_placed_in_time_fail_the_job_and_are_removed(ray_head, tmp_path):
    """Another job holds the free CPUs: the generator stays unplaced, so the start timeout ends the
    wait with the actors named (and they are killed, not left pending in the cluster)."""
    import ray

    from engine.errors import ClusterCapacityError
    from pipelines.cluster.actor_specs import GENERATOR, actor_names, generator_name
    from pipelines.cluster.topology import build_topology

    free = ray.available_resources().get("CPU", 0.0)

    @ray.remote
    class Blocker:
        def ready(self) -> bool:
            return True

    blocker = Blocker.options(num_cpus=free).remote() if free else None
    config = ray_config(tmp_path, generator_num_cpus=2, actor_start_timeout_s=5)
    config = dataclasses.replace(config, sae=dataclasses.replace(config.sae, enabled=False))
    try:
        if blocker is not None:
            ray.get(blocker.ready.remote(), timeout=60)
        with pytest.raises(ClusterCapacityError, match=rf"not started after 5s: .*{GENERATOR} \(2 CPU\)"):
            build_topology(config)
        wait_until(lambda: _no_actor_named(generator_name(config), config.ray.namespace), timeout=60,
                   what="generator removed")
    finally:
        if blocker is not None:
            ray.kill(blocker)
        kill_namespace_actors(config)
    assert all(_no_actor_named(name, config.ray.namespace) for name in actor_names(config))


def test_a_generator_that_cannot_load_its_model_fails_the_job_with_its_own_error(ray_head, tmp_path):
    from engine.errors import ActorStartError
    from pipelines.cluster.actor_specs import GENERATOR, generator_name
    from pipelines.cluster.topology import build_topology

    config = ray_config(tmp_path, actor_start_timeout_s=120)
    config = dataclasses.replace(config, sae=dataclasses.replace(config.sae, enabled=False),
                                 backend=dataclasses.replace(config.backend, model_id=str(tmp_path / "no-such-model")))
    try:
        with pytest.raises(ActorStartError, match=rf"{GENERATOR} failed to start: .*ModelLoadError: cannot load "
                                                  r"model '.*no-such-model'") as err:
            build_topology(config)
        assert 'File "' not in str(err.value) and "\x1b[" not in str(err.value)  # the cause, not Ray's traceback
        wait_until(lambda: _no_actor_named(generator_name(config), config.ray.namespace), timeout=60,
                   what="generator removed")
    finally:
        kill_namespace_actors(config)
