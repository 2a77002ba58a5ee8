"""``raylens embed``, ``raylens capture`` and ``raylens compare``, run in-process through ``main``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from pipelines.cli import main

TEXTS = ["n : Nat", "⊢ n + 0 = n", "The sky is blue."]
NAMES = "blocks.1.attn.*,blocks.*.hook_resid_post"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def reference(engine, tmp_path_factory):
    """A capture written through the engine: what ``compare`` diffs against."""
    out = tmp_path_factory.mktemp("reference")
    engine.capture(prompt="Hello there", names=NAMES.split(","), out=out)
    return out


def test_embed_writes_the_engines_embeddings(capsys, engine, tmp_path):
    texts = tmp_path / "states.txt"
    texts.write_text("\n".join(TEXTS) + "\n\n", encoding="utf-8")  # a blank line at the end shifts no row
    code, _, err = run(capsys, "embed", "--texts-file", str(texts), "--out", str(tmp_path / "emb.npy"),
                       "--layer", "5", "--pool", "last")
    assert code == 0, err
    written = np.load(tmp_path / "emb.npy")
    expected = engine.embed(TEXTS, layer=5, pool="last")
    assert written.dtype == np.float32 and written.shape == expected.shape
    assert np.array_equal(written, expected), f"CLI embeddings differ by {np.abs(written - expected).max():.3g}"


def test_capture_then_compare_with_itself_exits_0(capsys, reference, tmp_path):
    out = tmp_path / "capture"
    code, _, err = run(capsys, "capture", "--prompt", "Hello there", "--names", NAMES, "--out", str(out))
    assert code == 0, err
    assert (out / "tensors.safetensors").is_file() and (out / "manifest.json").is_file()
    code, report, _ = run(capsys, "compare", str(out), str(reference))
    assert code == 0, report
    assert "0 mismatched" in report and "MISMATCH" not in report


def _reference_by_another_tool(reference, tmp_path, edit):
    """A plain safetensors file with the same names, as another implementation would write it."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(reference / "tensors.safetensors"))
    edit(tensors)
    path = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_compare_reports_a_changed_tensor_and_exits_1(capsys, reference, tmp_path):
    def nudge(tensors):
        tensors["blocks.1.attn.hook_v"] = tensors["blocks.1.attn.hook_v"] + 0.01

    other = _reference_by_another_tool(reference, tmp_path, nudge)
    code, report, _ = run(capsys, "compare", str(reference), str(other))
    assert code == 1
    bad = [line for line in report.splitlines() if line.startswith("MISMATCH")]
    assert len(bad) == 1 and "blocks.1.attn.hook_v" in bad[0] and "max|a-b| 0.01" in bad[0], report
    code, report, _ = run(capsys, "compare", str(reference), str(other), "--atol", "0.02")
    assert code == 0, f"a looser tolerance must accept the nudge:\n{report}"


def test_compare_reports_missing_extra_and_reshaped_names(capsys, reference, tmp_path):
    def reshape(tensors):
        del tensors["blocks.0.hook_resid_post"]
        tensors["blocks.0.attn.hook_q"] = torch.zeros(2, 2)
        tensors["blocks.1.attn.hook_k"] = tensors["blocks.1.attn.hook_k"].unsqueeze(0)  # a kept batch dimension

    other = _reference_by_another_tool(reference, tmp_path, reshape)
    code, out, _ = run(capsys, "compare", str(reference), str(other), "--json")
    assert code == 1
    report = {t["name"]: t for t in json.loads(out)["tensors"]}
    assert report["blocks.0.hook_resid_post"]["status"] == "only_a"
    assert report["blocks.0.attn.hook_q"]["status"] == "only_b"
    assert report["blocks.1.attn.hook_k"]["status"] == "shape"
    assert "leading dimension of 1" in report["blocks.1.attn.hook_k"]["detail"]
    assert report["blocks.1.attn.hook_v"]["status"] == "ok"


def test_compare_flags_captures_of_different_inputs(capsys, engine, reference, tmp_path):
    other = tmp_path / "other"
    engine.capture(prompt="Goodbye", names=["blocks.0.hook_resid_post"], out=other)
    shutil.copy(reference / "tensors.safetensors", other / "tensors.safetensors")
    code, _, err = run(capsys, "compare", str(reference), str(other))
    assert code == 1 and "different input_ids" in err


@pytest.mark.parametrize("argv,message", [
    (["compare", "no/such/dir", "other/"], "`capture` must be a capture directory"),
    (["compare", "a", "b", "--rtol", "-1"], None),
    (["capture", "--prompt", "hi", "--names", "blocks.0.attn.hook_qq", "--out", "x"], "is not a known internal"),
    (["capture", "--input-ids", "1,x", "--out", "x"], "--input-ids must be comma-separated integers"),
    (["embed", "--texts-file", "missing.txt", "--out", "e.npy"], "`--texts-file` must be an existing file"),
])
def test_user_mistakes_exit_2_with_one_line(capsys, tmp_path, reference, argv, message):
    if message is None:  # a bad tolerance on real captures
        argv = ["compare", str(reference), str(reference), "--rtol", "-1"]
        message = "`rtol` must be a number >= 0, got -1.0"
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("raylens: error:")


def test_embed_refuses_an_unknown_output_format(capsys, tmp_path):
    texts = tmp_path / "t.txt"
    texts.write_text("hello\n")
    code, _, err = run(capsys, "embed", "--texts-file", str(texts), "--out", str(tmp_path / "e.csv"))
    assert code == 2 and "`--out` must end in .parquet or .npy" in err
