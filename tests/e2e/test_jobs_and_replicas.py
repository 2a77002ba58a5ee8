"""Jobs on shared actors, on a real local head bound to 127.0.0.1: generator replicas, actors keyed
by config, a line that fails alone, request ids unique per run, and `raylens submit` arguments that
no shell reads — each bounded in time."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import yaml

from tests.e2e.conftest import end_namespace, ray_config

pytestmark = pytest.mark.timeout(900)


def changed(config, section: str, **values):
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)})


def write_prompts(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def config_file(config, path):
    path.write_text(yaml.safe_dump(config.to_dict()))
    return path


def results(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def store_sql(config, sql, params=None):
    import ray

    from pipelines.cluster.actor_specs import STORE, actor_roles

    store = ray.get_actor(actor_roles(config)[STORE], namespace=config.ray.namespace)
    return ray.get(store.sql.remote(sql, params or []), timeout=120)


def raylens_actors(namespace) -> set[str]:
    from pipelines.cluster.ending import listed_names

    return {name for name in listed_names(namespace) if name.startswith("raylens-")}


@pytest.fixture(scope="module")
def base(ray_head, tmp_path_factory):
    """SAE off (no SAE workers to start): one namespace for the whole module, cleaned up at the end."""
    folder = tmp_path_factory.mktemp("jobs")
    config = ray_config(folder, generator_max_concurrency=2)
    config = changed(config, "sae", enabled=False).with_paths_under(folder)  # as a job sees it: absolute paths
    yield config
    end_namespace(config.ray.namespace, timeout_s=60)


def test_two_generator_replicas_share_a_file_and_a_resume_runs_only_the_lines_left(base, tmp_path, capsys):
    import ray

    from pipelines.cluster.topology import build_topology
    from pipelines.jobs.generate import main

    config = changed(base, "ray", generators=2)
    rows = [{"prompt": "What is the capital of France?", "max_tokens": 6, "temperature": 0, "request_id": f"r{i}"}
            for i in range(6)]
    prompts, out, cfg = tmp_path / "p.jsonl", tmp_path / "out.jsonl", config_file(config, tmp_path / "c.yaml")
    write_prompts(prompts, rows)
    assert main(["--config", str(cfg), "--prompts", str(prompts), "--out", str(out)]) == 0
    first = results(out)
    assert sorted(r["line"] for r in first) == [1, 2, 3, 4, 5, 6]
    assert len({r["output_text"] for r in first}) == 1  # greedy: the same answer from either replica
    topo = build_topology(config)
    served = [ray.get(g.stats.remote(), timeout=120)["requests"] for g in topo.generators]
    assert len(set(g._actor_id for g in topo.generators)) == 2 and all(n > 0 for n in served), served
    assert sum(served) == 6

    out.write_text("".join(json.dumps(r) + "\n" for r in first[:4]))  # as if the job stopped after four lines
    capsys.readouterr()
    assert main(["--config", str(cfg), "--prompts", str(prompts), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    final = results(out)
    assert summary["requests"] == 2 and sorted(r["line"] for r in final) == [1, 2, 3, 4, 5, 6]
    resumed = final[4:]
    # their ids were claimed by the first run, so the resumed requests run under ids of their own
    assert all(r["request_id"].startswith(f"{r['given_request_id']}~") for r in resumed), resumed


def test_a_job_with_another_store_path_gets_its_own_actors_and_never_the_old_ones(base, tmp_path):
    import ray

    from engine.errors import ActorConfigConflictError
    from pipelines.cluster.actor_specs import STORE, actor_roles
    from pipelines.cluster.topology import build_topology
    from pipelines.jobs.generate import read_prompts, run

    other = changed(base, "activations", db_path=str(tmp_path / "other.duckdb"))
    first, second = build_topology(base), build_topology(other)
    assert actor_roles(base)[STORE] != actor_roles(other)[STORE]
    assert first.store._actor_id != second.store._actor_id and first.generator._actor_id != second.generator._actor_id
    write_prompts(tmp_path / "p.jsonl", [{"prompt": "Say hi.", "max_tokens": 3, "temperature": 0,
                                          "request_id": "in-other-store"}])
    summary = run(other, read_prompts(tmp_path / "p.jsonl"), tmp_path / "o.jsonl", progress=lambda _: None)
    assert summary["requests"] == 1 and summary["failed"] == 0
    assert store_sql(other, "SELECT request_id FROM requests") == [("in-other-store",)]
    assert store_sql(base, "SELECT count(*) FROM requests WHERE request_id = 'in-other-store'") == [(0,)]
    assert ray.get(first.store.db_path.remote(), timeout=60) == base.activations.db_path  # the old one is untouched

    clash = changed(other, "activations", threads=1)  # the same file, other settings: DuckDB allows one writer
    before = raylens_actors(base.ray.namespace)
    with pytest.raises(ActorConfigConflictError, match=r"`activations` must match the settings of the running "
                                                       r"raylens-store-.*\(threads: 2 there, 1 here\).*raylens stop"):
        build_topology(clash)
    assert raylens_actors(base.ray.namespace) == before  # nothing created


def test_a_line_that_fails_at_run_time_fails_alone_and_the_job_goes_on(base, tmp_path):
    from pipelines.jobs.generate import read_prompts, run

    broken = {"language": "python", "entrypoint": "m", "source": "raise RuntimeError('boom while loading')\n"
                                                                 "def m(event, tokenizer):\n    return None\n"}
    rows = [{"prompt": "Say hi.", "max_tokens": 3, "temperature": 0, "request_id": "fine-1"},
            {"prompt": "Say hi.", "max_tokens": 3, "request_id": "broken-mod", "mods": [broken]},
            {"input_ids": [1, 2**31 - 1], "max_tokens": 3, "request_id": "out-of-vocab"},
            {"prompt": "Say bye.", "max_tokens": 3, "temperature": 0, "request_id": "fine-2"}]
    write_prompts(tmp_path / "p.jsonl", rows)
    summary = run(base, read_prompts(tmp_path / "p.jsonl"), tmp_path / "o.jsonl", progress=lambda _: None)
    by_id = {r["request_id"]: r for r in results(tmp_path / "o.jsonl")}
    assert summary["requests"] == 4 and summary["failed"] == 2
    assert by_id["broken-mod"]["finish_reason"] == "error" and "boom while loading" in by_id["broken-mod"]["error"]
    assert by_id["out-of-vocab"]["finish_reason"] == "error" and "vocab" in by_id["out-of-vocab"]["error"].lower()
    assert "Traceback" not in by_id["broken-mod"]["error"]
    assert by_id["fine-1"]["output_text"] and by_id["fine-2"]["output_text"]  # finished lines are kept
    assert {r["line"] for r in by_id.values()} == {1, 2, 3, 4}


def test_a_job_whose_every_line_ends_in_error_counts_them_failed(base, tmp_path):
    """Lines that run but end with ``finish_reason: error`` (here a mod's EmitError) are failed
    lines: the summary counts them (the job exits 1 on any) — never ``failed: 0``."""
    from pipelines.jobs.generate import read_prompts, run

    emit = {"language": "python", "entrypoint": "m", "source": (
        "from quote_mod_sdk import Prefilled, mod\n\n@mod\ndef m(event, actions, tokenizer):\n"
        "    if isinstance(event, Prefilled):\n        return actions.emit_error('refused on purpose')\n"
        "    return None\n")}
    rows = [{"prompt": p, "max_tokens": 3, "request_id": f"err-{i}", "mods": [emit]} for i, p in enumerate(["a", "b"])]
    write_prompts(tmp_path / "p.jsonl", rows)
    summary = run(base, read_prompts(tmp_path / "p.jsonl"), tmp_path / "o.jsonl", progress=lambda _: None)
    out = results(tmp_path / "o.jsonl")
    assert [r["finish_reason"] for r in out] == ["error", "error"] and "refused on purpose" in out[0]["error"]
    assert summary["requests"] == 2 and summary["failed"] == 2
    fine = [{"prompt": "Say hi.", "max_tokens": 2, "request_id": "fine-3"}]  # positive control
    write_prompts(tmp_path / "fine.jsonl", fine)
    assert run(base, read_prompts(tmp_path / "fine.jsonl"), tmp_path / "f.jsonl", progress=lambda _: None)["failed"] == 0


def _rows_match_tokens(config, request_id) -> tuple[int, int]:
    """(stored SAE rows of a request, how many name another token than its requests row)."""
    [(prompt_ids, output_ids)] = store_sql(config, "SELECT prompt_ids, output_ids FROM requests WHERE request_id = ?",
                                           [request_id])
    sequence = list(prompt_ids) + list(output_ids)
    rows = store_sql(config, "SELECT token_position, token_id FROM activations WHERE request_id = ?", [request_id])
    return len(rows), sum(1 for position, token in rows if sequence[position] != token)


def test_a_reused_request_id_never_mixes_two_runs_rows_and_a_summary_counts_its_job_only(base, tmp_path):
    from pipelines.cluster.topology import build_topology
    from pipelines.jobs.generate import read_prompts, run

    config = changed(changed(base, "sae", enabled=True, block_steps=2), "ray", sae_workers=1,
                     sae_worker_num_cpus=0.5)
    build_topology(config)
    line = {"prompt": "Tell me a short story.", "max_tokens": 10, "temperature": 1.0, "ignore_eos": True,
            "request_id": "dup"}
    summaries, outs = {}, {}

    def job(name, seed):
        write_prompts(tmp_path / f"{name}.jsonl", [line | {"seed": seed}])
        summaries[name] = run(config, read_prompts(tmp_path / f"{name}.jsonl"), tmp_path / f"{name}.out",
                              progress=lambda _: None)
        outs[name] = results(tmp_path / f"{name}.out")[0]

    job("first", 1)
    other = threading.Thread(target=job, args=("neighbour", 3))  # a concurrent job on the same store
    other.start()
    job("second", 2)
    other.join(timeout=600)
    first, second = outs["first"], outs["second"]
    assert first["request_id"] == "dup" and second["request_id"].startswith("dup~")
    assert second["given_request_id"] == "dup"
    assert first["output_text"] != second["output_text"]  # positive control: the two runs read other tokens
    for rid in (first["request_id"], second["request_id"], outs["neighbour"]["request_id"]):
        rows, wrong = _rows_match_tokens(config, rid)
        assert rows > 0 and wrong == 0, f"{rid}: {wrong} of {rows} SAE rows name other tokens than its requests row"
    own = store_sql(config, "SELECT count(*) FROM activations WHERE request_id = ?", [second["request_id"]])[0][0]
    total = store_sql(config, "SELECT count(*) FROM activations")[0][0]
    assert summaries["second"]["sae_rows"] == own < total  # this job's rows, not its neighbour's


def test_submit_hands_a_hostile_out_path_and_spaces_to_the_job_untouched(ray_head, base, tmp_path, capsys):
    from pipelines.cli import main

    folder = tmp_path / "a folder"
    folder.mkdir()
    prompts = folder / "my prompts.jsonl"
    out = folder / "out $HOME $(touch PWNED) `touch PWNED2`; touch PWNED3.jsonl"
    write_prompts(prompts, [{"prompt": "Say hello.", "max_tokens": 3, "temperature": 0, "request_id": "hostile"}])
    code = main(["submit", "--prompts", str(prompts), "--out", str(out), "--address", ray_head.dashboard_url,
                 "--config", str(config_file(base, folder / "job config.yaml")), "--timeout", "600"])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert results(out)[0]["request_id"] == "hostile"
    injected = [p for root in (tmp_path, ray_head.temp_dir) for p in root.rglob("PWNED*")]
    assert not injected, f"the shell ran part of --out: {injected}"


def test_raylens_stop_all_ends_every_raylens_actor_of_the_namespace(base, tmp_path, capsys):
    """Last in the module: the way to replace actors that run with other settings."""
    from pipelines.cli import main
    from pipelines.cluster.topology import build_topology

    build_topology(base)
    running = raylens_actors(base.ray.namespace)
    assert len(running) >= 3  # store, ingest, generator at least (positive control)
    assert main(["stop", "--all", "--config", str(config_file(base, tmp_path / "c.yaml"))]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["stopped"]) == running and report["still_listed"] == []
    assert not raylens_actors(base.ray.namespace)  # gone when the command returns: the next job starts afresh
