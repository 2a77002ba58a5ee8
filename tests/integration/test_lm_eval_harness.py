"""lm-evaluation-harness (PyPI ``lm-eval``) pointed at a real loopback server, against lm-eval's own
``hf`` model on the same weights: the reference is lm-eval itself, so this checks what a user of the
harness would see (the numbers and every sample's answer), not our reading of the protocol.

The tasks are local (tests/data/lm_eval: YAML + JSON lines, loaded with ``dataset_path: json``);
the ``hf`` model and the API models' tokenizer load from the embedded model's converted directory.
Nothing is downloaded: the hub and datasets are set offline before lm-eval is imported.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.helpers import FP32_NOISE_TOL, REPO

pytestmark = pytest.mark.slow

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TASKS = REPO / "tests" / "data" / "lm_eval"


@pytest.fixture(scope="module")
def server(engine):
    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    settings = ServeSettings(max_new_tokens=64, request_timeout_s=300)
    with serve_in_thread(build_app(engine, settings)) as url:
        yield url


@pytest.fixture(scope="module")
def model_dir(engine) -> str:
    """The converted directory the engine loaded (the ``hf`` model's weights and every tokenizer)."""
    from engine.model.loading import resolve_model_path

    return resolve_model_path(engine.backend.config.model_id, engine.backend.config.model_cache_dir)


@pytest.fixture(scope="module")
def in_repo_root():
    """The task YAMLs name their data files relative to the repository root, as a user runs them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        yield


def evaluate(task: str, model: str, model_args: dict[str, Any], *, chat: bool) -> tuple[dict, dict[int, dict]]:
    """(the task's aggregate results, its logged samples by doc_id), greedy, one request at a time."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task],
                                  task_manager=TaskManager(include_path=str(TASKS)), apply_chat_template=chat,
                                  log_samples=True, batch_size=1, use_cache=None, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0)
    samples = {s["doc_id"]: s for s in out["samples"][task]}
    return out["results"][task], samples


def hf_args(model_dir: str) -> dict[str, Any]:
    return {"pretrained": model_dir, "dtype": "float32", "device": "cpu"}


def api_args(server: str, route: str, engine, model_dir: str) -> dict[str, Any]:
    return {"base_url": f"{server}/v1/{route}", "model": engine.backend.info.model_id, "tokenizer_backend": "huggingface",
            "tokenizer": model_dir, "max_retries": 1, "timeout": 300}


def test_generation_task_through_chat_completions_equals_lm_evals_hf_model(server, engine, model_dir, in_repo_root):
    served, served_samples = evaluate("raylens_qa", "local-chat-completions",
                                      api_args(server, "chat/completions", engine, model_dir), chat=True)
    local, local_samples = evaluate("raylens_qa", "hf", hf_args(model_dir), chat=True)

    assert sorted(served_samples) == sorted(local_samples) == list(range(6))
    for doc_id, reference in local_samples.items():
        sample = served_samples[doc_id]
        assert sample["resps"] == reference["resps"], f"doc {doc_id}: the served reply differs from lm-eval's hf model"
        assert sample["filtered_resps"] == reference["filtered_resps"]
        assert sample["exact_match"] == reference["exact_match"]
    assert served["exact_match,last_word"] == local["exact_match,last_word"]
    # positive control: the metric separates right from wrong answers on this task (neither all 0 nor all 1),
    # so equal scores are not equal by construction
    scores = {float(s["exact_match"]) for s in local_samples.values()}
    assert scores == {0.0, 1.0}, scores
    # the replies are real text, cut by the task's stop string and token budget
    assert all(s["resps"][0][0].strip() and "\n" not in s["resps"][0][0] for s in served_samples.values())


def test_multiple_choice_task_through_completions_equals_lm_evals_hf_model(server, engine, model_dir, in_repo_root):
    served, served_samples = evaluate("raylens_choices", "local-completions",
                                      api_args(server, "completions", engine, model_dir), chat=False)
    local, local_samples = evaluate("raylens_choices", "hf", hf_args(model_dir), chat=False)

    assert sorted(served_samples) == sorted(local_samples) == list(range(6))
    for doc_id, reference in local_samples.items():
        sample = served_samples[doc_id]
        # one (loglikelihood, is_greedy) per choice; sums of float32 log-softmax over a few tokens
        assert len(sample["filtered_resps"]) == len(reference["filtered_resps"]) == 4
        for (ll, greedy), (ref_ll, ref_greedy) in zip(sample["filtered_resps"], reference["filtered_resps"]):
            assert ll == pytest.approx(ref_ll, rel=FP32_NOISE_TOL, abs=FP32_NOISE_TOL), f"doc {doc_id}"
            assert greedy == ref_greedy, f"doc {doc_id}"
        assert sample["acc"] == reference["acc"] and sample["acc_norm"] == reference["acc_norm"], f"doc {doc_id}"
    assert served["acc,none"] == local["acc,none"] and served["acc_norm,none"] == local["acc_norm,none"]
    # positive control: choices' loglikelihoods differ by far more than the tolerance, and the task has both
    # right and wrong answers, so equal accuracies say the served numbers rank the choices as hf does
    spreads = [max(ll for ll, _ in s["filtered_resps"]) - min(ll for ll, _ in s["filtered_resps"])
               for s in local_samples.values()]
    assert min(spreads) > 100 * FP32_NOISE_TOL, spreads
    assert {float(s["acc"]) for s in local_samples.values()} == {0.0, 1.0}
