"""guidellm (PyPI), unchanged, against a loopback server: every request it sends succeeds (its /health
pre-flight, streamed chat completions with its own fields), and the in-process replay runs the very
same prompts. Numbers are reported, never asserted on (timings depend on the machine)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_guidellm_run_against_the_server_and_its_in_process_replay(engine):
    from pipelines.bench.guidellm_serving import GuidellmBench, format_guidellm, run_guidellm_bench

    bench = GuidellmBench(concurrency=4, requests=4, prompt_tokens=32, output_tokens=6)
    report = run_guidellm_bench(engine, bench)

    served, local = report["served"], report["in_process"]
    assert served["requests"] == local["requests"] == 4
    # guidellm asks for exactly output_tokens (ignore_eos) and counts them from the server's usage;
    # the in-process replay asks the same and counts its token events
    assert served["output_tokens"] == local["output_tokens"] == 4 * 6
    # the prompts guidellm made from the local tokenizer, with the chat template around them
    assert served["prompt_tokens_median"] > 32
    assert served["tokens_per_s"] > 0 and local["tokens_per_s"] > 0 and report["ratio"] > 0
    assert 0 < served["ttft_ms"]["p50"] <= served["ttft_ms"]["p95"]
    assert "served / in-process tokens/s" in format_guidellm(report)


def test_bench_settings_are_checked():
    from engine.errors import ConfigError
    from pipelines.bench.guidellm_serving import GuidellmBench

    with pytest.raises(ConfigError, match="`requests` must be >= `concurrency`"):
        GuidellmBench(concurrency=8, requests=4)
    with pytest.raises(ConfigError, match="`output_tokens` must be an integer >= 1"):
        GuidellmBench(output_tokens=0)
    with pytest.raises(ConfigError, match="`worker_processes` must be an integer >= 1"):
        GuidellmBench(worker_processes=True)  # a bool is not a count
    with pytest.raises(ConfigError, match="`timeout_s` must be a number > 0"):
        GuidellmBench(timeout_s="60")
    assert GuidellmBench().concurrency == 8  # positive control: the defaults pass
