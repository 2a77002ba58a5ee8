"""Ray Job entry point: prompts JSONL in, results JSONL out, through the raylens actors.

    ray job submit --working-dir . -- python -m pipelines.generate --config configs/local.yaml \\
        --prompts prompts.jsonl --out results.jsonl

Each input line is a JSON object with ``prompt`` (a user turn) or ``messages`` (a chat) or
``input_ids``, and optionally ``mods`` (mod file paths, ``file.py:function``, or payload dicts),
``request_id``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_tokens``,
``ignore_eos``, ``tools``. Relative paths (prompts, out, and the config's store and spool) are
taken under ``--workdir`` (default: the current directory): a Ray Job runs in a throwaway copy of
``--working-dir``, so pass ``--workdir $PWD`` to keep results and the store where you are. The
whole file is checked before anything runs; a bad line is named (``prompts.jsonl:7: …``) and the
job exits 2. Mod files are read here and shipped to the
generator as inline-source payloads, so they need not exist where the generator runs.

Requests run concurrently on the GeneratorActor (``ray.generator_max_concurrency`` at a time);
each result line is written as it finishes (with its input ``line``), so a re-run with the same
``--out`` skips lines already done. If the generator dies, the request's unstored SAE blocks are
recorded as missing, and the request runs once more under a new id (``<id>-retry1``). The end
prints a summary: requests, tokens, tokens/s, SAE rows, ingest delivered/spooled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["PromptLine", "read_prompts", "run", "main", "InputError"]

_PARAMS = {"max_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int, "seed": int,
           "stop_tokens": list, "tools": list, "ignore_eos": bool}
_SOURCES = ("prompt", "messages", "input_ids")


class InputError(Exception):
    """A prompts file problem; the message names the file and line."""


@dataclass(frozen=True)
class PromptLine:
    line: int
    request: dict[str, Any]  # Engine.generate keyword arguments, mods as payload dicts


def _mod_payloads(specs: Any, where: str) -> list[dict[str, Any]]:
    from mods.loading import ModPayloadError, load_mod_from_payload, payload_for_file

    if not isinstance(specs, list):
        raise InputError(f"{where}: `mods` must be a list of mod file paths or payload objects")
    payloads = []
    for spec in specs:
        if isinstance(spec, dict):
            try:
                load_mod_from_payload(spec)
            except ModPayloadError as err:
                raise InputError(f"{where}: bad mod payload: {err}") from None
            payloads.append(dict(spec))
            continue
        if not isinstance(spec, str):
            raise InputError(f"{where}: a mod must be a path string or a payload object, got {spec!r}")
        try:
            payloads.append(payload_for_file(spec))  # the code travels; the path need not exist there
        except ModPayloadError as err:
            raise InputError(f"{where}: {err}") from None
    return payloads


def _parse_line(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(data, dict):
        raise InputError(f"{where}: each line must be a JSON object")
    given = [k for k in _SOURCES if k in data]
    if len(given) != 1:
        raise InputError(f"{where}: give exactly one of prompt, messages, input_ids (got {given or 'none'})")
    unknown = sorted(set(data) - set(_SOURCES) - set(_PARAMS) - {"mods", "request_id"})
    if unknown:
        raise InputError(f"{where}: unknown field(s) {', '.join(unknown)}; known: "
                         f"{', '.join(list(_SOURCES) + list(_PARAMS) + ['mods', 'request_id'])}")
    for key, kind in _PARAMS.items():
        if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool) and kind is not bool):
            raise InputError(f"{where}: `{key}` has the wrong type ({type(data[key]).__name__})")
    request = {k: v for k, v in data.items() if k != "mods"}
    request["mods"] = _mod_payloads(data.get("mods", []), where)
    request.setdefault("request_id", str(uuid.uuid4()))
    return request


def read_prompts(path: str | Path) -> list[PromptLine]:
    """Every request of a prompts file, checked; :class:`InputError` names the first bad line."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"prompts file `{file}` does not exist")
    lines = []
    for number, text in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if text.strip():
            lines.append(PromptLine(number, _parse_line(text, f"{file}:{number}")))
    if not lines:
        raise InputError(f"prompts file `{file}` holds no requests")
    return lines


def _done_lines(out: Path) -> set[int]:
    if not out.is_file():
        return set()
    done = set()
    for text in out.read_text(encoding="utf-8").splitlines():
        try:
            done.add(int(json.loads(text)["line"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a torn last line from a killed run: that request runs again
    return done


def _settled(method: Any, *args: Any, timeout: float, attempts: int = 8) -> Any:
    """``ray.get(method.remote(*args))`` for an idempotent method, repeated while its actor is
    restarting (``max_restarts``: it comes back)."""
    import ray
    from ray.exceptions import ActorUnavailableError

    for attempt in range(attempts):
        try:
            return ray.get(method.remote(*args), timeout=timeout)
        except ActorUnavailableError:
            if attempt == attempts - 1:
                raise
            time.sleep(min(10.0, 0.5 * 2**attempt))


def run(config: Any, lines: Sequence[PromptLine], out: Path, *, progress=print) -> dict[str, Any]:
    """Run ``lines`` through the actors (the cluster must be connected); returns the summary."""
    import ray
    from ray.exceptions import RayActorError

    from .topology import build_topology

    topo = build_topology(config)
    before = _settled(topo.store.counts, timeout=config.ray.call_timeout_s)
    timeout = config.ray.call_timeout_s
    todo = list(lines)
    inflight: dict[Any, tuple[PromptLine, int]] = {}
    finished = tokens = failures = 0
    started = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as sink:
        while todo or inflight:
            while todo and len(inflight) < config.ray.generator_max_concurrency:
                item = todo.pop(0)
                inflight[topo.generator.generate.remote(item.request)] = (item, 0)
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=timeout)
            for ref in ready:
                item, attempt = inflight.pop(ref)
                try:
                    result = ray.get(ref, timeout=timeout)
                except RayActorError as err:
                    rid = item.request["request_id"]
                    missing = _settled(topo.store.abandon_request, rid, f"generator died: {type(err).__name__}",
                                       timeout=timeout)
                    progress(f"line {item.line}: the generator died during {rid} ({missing} SAE block(s) recorded "
                             "missing)" + ("; running it again" if attempt == 0 else "; giving up"))
                    if attempt == 0:
                        _settled(topo.generator.stats, timeout=timeout)  # wait for the restarted generator
                        retry = PromptLine(item.line, {**item.request, "request_id": f"{rid}-retry1"})
                        inflight[topo.generator.generate.remote(retry.request)] = (retry, 1)
                        continue
                    result = {"request_id": rid, "error": f"generator died twice: {err}", "finish_reason": "error"}
                    failures += 1
                result["line"] = item.line
                sink.write(json.dumps(result) + "\n")
                sink.flush()
                finished += 1
                tokens += result.get("metadata", {}).get("generated_tokens", 0)
                elapsed = time.perf_counter() - started
                progress(f"[{finished}/{len(lines)}] line {item.line} {result.get('finish_reason')} "
                         f"{tokens} tokens {tokens / elapsed:.1f} tok/s")
    drained = _settled(topo.generator.drain, timeout=timeout * 4)
    ingest = _settled(topo.ingest.flush, timeout=timeout)
    after = _settled(topo.store.counts, timeout=timeout)
    elapsed = time.perf_counter() - started
    return {
        "requests": finished,
        "failed": failures,
        "tokens": tokens,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 2) if elapsed else 0.0,
        "sae_rows": after["activations"] - before["activations"],
        "sae_blocks_missing": after["missing_blocks"] - before["missing_blocks"],
        "ingest_delivered": ingest["delivered"],
        "ingest_spooled": ingest["spooled"],
        "generator": drained,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="raylens YAML (default configs/local.yaml or $RAYLENS_CONFIG)")
    parser.add_argument("--prompts", required=True, help="JSONL, one request per line")
    parser.add_argument("--out", required=True, help="results JSONL (appended; done lines are skipped)")
    parser.add_argument("--address", help="Ray address (default: ray.address, 'auto')")
    parser.add_argument("--workdir", help="directory that relative paths (prompts, out, store, spool) are under; "
                                          "inside `ray job submit --working-dir .` pass your own: --workdir $PWD")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    from engine.config import load_config
    from engine.errors import RaylensError

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        base = Path(args.workdir or ".").resolve()
        config_path = Path(args.config) if args.config else None
        if config_path is not None and not config_path.is_absolute() and not config_path.exists():
            config_path = base / config_path
        config = load_config(config_path).with_paths_under(base)
        lines = read_prompts(base / args.prompts)
        out = base / args.out
        done = _done_lines(out)
        todo = [line for line in lines if line.line not in done]
        if done:
            progress(f"resuming: {len(done)} line(s) already in {out}, {len(todo)} to go")
        from .topology import connect

        connect(config, args.address)
        summary = run(config, todo, out, progress=progress)
    except (InputError, RaylensError) as err:
        if args.debug:
            raise
        print(f"raylens generate: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"summary": summary}), flush=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
