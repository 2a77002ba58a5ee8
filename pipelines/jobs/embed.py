"""Ray Job entry point: a texts file in, one embedding per text out (Parquet), on an EmbedActor.

    ray job submit --working-dir . -- python -m pipelines.jobs.embed --texts-file states.txt \\
        --out embeddings.parquet --workdir $PWD [--layer L] [--pool mean|last]

A texts file holds one text per line, or, when it ends in ``.jsonl``, one JSON string or
``{"text": ...}`` object per line, for texts that contain newlines. Row *i* of the output is line
*i* of the file, so a blank line before the last text is refused (blank lines at the end are
ignored: they shift nothing); so is a file that is not UTF-8. The whole
file is checked before anything runs; a bad line is named (``states.jsonl:7: …``) and the job
exits 2. Relative paths are taken under ``--workdir`` (a Ray Job runs in a copy of its working
dir, so pass ``--workdir $PWD`` to keep the output where you are).

The job creates its own EmbedActor with the resources the config gives the generator
(``ray.generator_num_cpus``/``generator_num_gpus``), sends it chunks of ``--chunk-size`` texts
(at most two in flight, so the actor never waits for the driver), and kills it at the end. The
output is written once, to a temporary name then renamed: a failed job leaves no partial file.
Parquet columns: ``line`` (the text's line in the file), ``text``, ``embedding`` (fixed-size
float32 list); the schema metadata records the model, layer and pooling.

``raylens embed`` reads and writes the same files in-process, without Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from engine.errors import InvalidRequestError, RaylensError

__all__ = ["TextLine", "read_texts", "write_embeddings", "run", "main"]

OUTPUT_SUFFIXES = (".parquet", ".npy")


@dataclass(frozen=True)
class TextLine:
    line: int  # 1-based line in the texts file
    text: str


def read_texts(path: str | Path) -> list[TextLine]:
    """Every text of a texts file, checked; :class:`InvalidRequestError` names the first bad line."""
    file = Path(path)
    if not file.is_file():
        raise InvalidRequestError(f"`--texts-file` must be an existing file, got `{file}`", parameter="texts_file",
                                  value=str(file))
    as_json = file.suffix == ".jsonl"
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise InvalidRequestError(f"`--texts-file` must be UTF-8 text, got byte 0x{err.object[err.start]:02x} at "
                                  f"offset {err.start} of `{file}`; save it as UTF-8", parameter="texts_file",
                                  value=str(file)) from None
    while lines and not lines[-1].strip():  # blank lines at the end shift no row
        lines.pop()
    texts = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            raise InvalidRequestError(f"{file}:{number}: each line must be a text (row {number} of the output is line "
                                      f"{number}), got a blank line; remove it", parameter="texts_file", value=number)
        if not as_json:
            texts.append(TextLine(number, raw))
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as err:
            raise InvalidRequestError(f"{file}:{number}: each line must be valid JSON ({err.msg} at column "
                                      f"{err.colno})", parameter="texts_file", value=number) from None
        text = data.get("text") if isinstance(data, dict) else data
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"{file}:{number}: each line must be a JSON string or an object with a "
                                      f"non-empty string `text`, got {raw[:60]!r}", parameter="texts_file",
                                      value=number)
        texts.append(TextLine(number, text))
    if not texts:
        raise InvalidRequestError(f"`--texts-file` must hold at least one text, got none in `{file}`",
                                  parameter="texts_file", value=str(file))
    return texts


def check_output(out: str | Path) -> Path:
    path = Path(out)
    if path.suffix not in OUTPUT_SUFFIXES:
        raise InvalidRequestError(f"`--out` must end in {' or '.join(OUTPUT_SUFFIXES)}, got `{out}`",
                                  parameter="out", value=str(out))
    return path


def write_embeddings(out: str | Path, lines: Sequence[TextLine], vectors: np.ndarray, *, model_id: str,
                     layer: int | None, pool: str) -> Path:
    """``vectors (n, d)`` as ``.npy`` (the array alone) or ``.parquet`` (line, text, embedding),
    written to a temporary name and renamed, so the file is complete or absent."""
    path = check_output(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        if path.suffix == ".npy":
            with partial.open("wb") as handle:
                np.save(handle, vectors.astype(np.float32, copy=False))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            flat = pa.array(vectors.astype(np.float32, copy=False).reshape(-1), type=pa.float32())
            table = pa.table({"line": pa.array([t.line for t in lines], type=pa.int64()),
                              "text": pa.array([t.text for t in lines], type=pa.string()),
                              "embedding": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])})
            meta = {"raylens.model_id": model_id, "raylens.layer": "final_norm" if layer is None else str(layer),
                    "raylens.pool": pool, "raylens.dim": str(vectors.shape[1])}
            pq.write_table(table.replace_schema_metadata(meta), partial)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def run(config: Any, texts: Sequence[str], *, layer: int | None = None, pool: str = "mean", batch_size: int = 16,
        chunk_size: int = 256, progress: Callable[[str], None] = lambda _: None) -> tuple[np.ndarray, dict[str, Any]]:
    """Embed ``texts`` on a new EmbedActor (the cluster must be connected); returns the
    ``(n, d)`` array and the actor's model info. The actor is killed at the end."""
    import ray

    from actors.embedder import EmbedActor
    from engine.model.capture import check_layer

    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidRequestError(f"`chunk_size` must be an int >= 1, got {chunk_size!r}", parameter="chunk_size",
                                  value=chunk_size)
    timeout = config.ray.call_timeout_s
    actor = EmbedActor.options(  # type: ignore[attr-defined]  # a Ray actor class
        num_cpus=config.ray.generator_num_cpus, num_gpus=config.ray.generator_num_gpus).remote(config.to_dict())
    try:
        info = ray.get(actor.info.remote(), timeout=config.ray.actor_start_timeout_s)
        if layer is not None:  # fail before any chunk runs, with the model's range
            check_layer(layer, info["num_layers"], parameter="layer")
        chunks = [list(texts[i:i + chunk_size]) for i in range(0, len(texts), chunk_size)]
        results: dict[int, np.ndarray] = {}
        inflight: dict[Any, int] = {}
        started, done = time.perf_counter(), 0
        next_chunk = 0
        while next_chunk < len(chunks) or inflight:
            while next_chunk < len(chunks) and len(inflight) < 2:
                inflight[actor.embed.remote(chunks[next_chunk], layer, pool, batch_size)] = next_chunk
                next_chunk += 1
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=timeout)
            if not ready:
                raise TimeoutError(f"no embedding chunk finished within ray.call_timeout_s={timeout} s")
            index = inflight.pop(ready[0])
            results[index] = ray.get(ready[0], timeout=timeout)
            done += len(chunks[index])
            progress(f"[{done}/{len(texts)}] {done / (time.perf_counter() - started):.1f} texts/s")
    finally:
        ray.kill(actor, no_restart=True)
    return np.concatenate([results[i] for i in range(len(chunks))]), info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.jobs.embed", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="raylens YAML (default configs/local.yaml or $RAYLENS_CONFIG)")
    parser.add_argument("--texts-file", required=True, help="one text per line, or .jsonl: JSON strings/{text}")
    parser.add_argument("--out", required=True, help="output: .parquet (line, text, embedding) or .npy")
    parser.add_argument("--layer", type=int, help="residual stream after this block (default: final norm output)")
    parser.add_argument("--pool", choices=("mean", "last"), default="mean")
    parser.add_argument("--batch-size", type=int, default=16, help="texts per forward pass")
    parser.add_argument("--chunk-size", type=int, default=256, help="texts per actor call")
    parser.add_argument("--address", help="Ray address (default: ray.address, 'auto')")
    parser.add_argument("--workdir", help="directory that relative paths are under (in a Ray Job: --workdir $PWD)")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    from engine.config import load_job_config

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        base, config = load_job_config(args.config, args.workdir)
        lines = read_texts(base / args.texts_file)
        out = check_output(base / args.out)
        from pipelines.cluster.connection import connect

        connect(config, args.address)
        vectors, info = run(config, [t.text for t in lines], layer=args.layer, pool=args.pool,
                            batch_size=args.batch_size, chunk_size=args.chunk_size, progress=progress)
        write_embeddings(out, lines, vectors, model_id=info["model_id"], layer=args.layer, pool=args.pool)
    except RaylensError as err:
        if args.debug:
            raise
        print(f"raylens embed: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"summary": {"texts": len(lines), "dim": int(vectors.shape[1]), "out": str(out)}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
