"""Ray Job entry point: prompts JSONL in, results JSONL out, through the raylens actors.

    ray job submit --working-dir . -- python -m pipelines.jobs.generate --config configs/local.yaml \\
        --prompts prompts.jsonl --out results.jsonl

The prompts file is read and every value checked first (:mod:`pipelines.jobs.prompts_file`); a bad line
is named (``prompts.jsonl:7: …``) and the job exits 2. Relative paths (prompts, out, and the
config's store and spool) are taken under ``--workdir`` (default: the current directory): a Ray Job
runs in a throwaway copy of ``--working-dir``, so pass ``--workdir $PWD`` to keep results and the
store where you are. ``raylens submit`` passes its arguments in the job's environment
(``--args-from-env``), so no value is ever read by a shell.

Requests go to the config's GeneratorActor replicas (``ray.generators``, or as many as
``raylens scale`` left running) where the replica router puts them (``ray.router``: by default the
replica whose prefix cache holds most of the prompt's leading blocks; :mod:`pipelines.cluster.router`),
up to ``ray.generator_max_concurrency`` in flight per replica; each result line is written as it finishes
(with its input ``line``), so a re-run with the same ``--out`` skips lines already done; when the
job's lines are done the file is put back in input order. A line
that fails at run time (the engine refuses it, its mod does not load) is written with
``finish_reason: "error"`` and an ``error``, and the job goes on. If a generator dies, the
request's unstored SAE blocks are recorded as missing, and the request runs once more under a new
id (``<id>-retry1``), on another replica when one is up (else on the restarted one). A replica that
is draining (``raylens scale`` removing it) refuses the request, which goes to another.

Request ids: before running, the job claims its ids in the store. An id that an earlier run used
(a resume after a cancel, a repeated id) runs as ``<id>~<run id>``, because stored SAE rows and
their block ids belong to the run that wrote them; the result line keeps the id you gave as
``given_request_id``. The summary counts this job's requests only: requests, tokens, tokens/s,
SAE rows and missing blocks of its ids, ingest delivered/spooled.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .prompts_file import InputError, PromptLine, read_prompts

__all__ = ["PromptLine", "read_prompts", "run", "main", "InputError", "JOB_ARGS_ENV", "job_entrypoint",
           "encode_job_args"]

#: The environment variable ``raylens submit`` puts the job's arguments in (:func:`encode_job_args`).
JOB_ARGS_ENV = "RAYLENS_JOB_ARGS"


def job_entrypoint() -> str:
    """The Ray Job entrypoint ``raylens submit`` uses: a constant, with no user value in it (the
    values travel in :data:`JOB_ARGS_ENV` of the job's runtime_env)."""
    return f"python -m pipelines.jobs.generate --args-from-env {JOB_ARGS_ENV}"


def encode_job_args(argv: Sequence[str]) -> str:
    """The arguments as base64 of a JSON list. Not plain JSON: Ray expands ``$VAR`` and ``${VAR}``
    in runtime_env values, which would change a path holding a ``$``; base64 has none."""
    return base64.urlsafe_b64encode(json.dumps(list(argv)).encode()).decode("ascii")


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


def _task_error(err: Exception) -> str:
    """The cause of a failed ``generate`` call, in one line (not Ray's wrapped traceback)."""
    cause = getattr(err, "cause", None) or err
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


@dataclass
class _Flight:
    """One request on its way: which line, under which ids, on which replica (its actor name),
    which attempt."""

    item: PromptLine
    given_id: str | None  # the id its line gave (None: none given)
    replica: str = ""
    attempt: int = 0

    @property
    def request_id(self) -> str:
        """The id it runs under, claimed for it before the run."""
        rid = self.item.request.request_id
        assert rid is not None  # internal invariant: every line's id is claimed before it is dispatched
        return rid


@dataclass
class _Tally:
    finished: int = 0
    failed: int = 0
    tokens: int = 0
    ids: list[str] = field(default_factory=list)  # every id this job ran under (retries included)


def run(config: Any, lines: Sequence[PromptLine], out: Path, *, progress=print) -> dict[str, Any]:
    """Run ``lines`` through the actors (the cluster must be connected); returns the summary."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    from engine.config import REQUEST_ID_MAX_CHARS
    from engine.errors import ReplicaDrainingError
    from pipelines.cluster.prompt_keys import prompt_keys_for
    from pipelines.cluster.replicas import ReplicaSet
    from pipelines.cluster.router import RouteRequest
    from pipelines.cluster.topology import build_topology

    topo = build_topology(config)
    replicas = ReplicaSet(config).start()
    keys = prompt_keys_for(config, topo.generator)
    timeout = config.ray.call_timeout_s
    run_id = uuid.uuid4().hex[:8]
    given = [line.request.request_id for line in lines]
    claimed = _settled(topo.store.claim_request_ids, given, run_id, REQUEST_ID_MAX_CHARS, timeout=timeout) \
        if lines else []
    todo = [(PromptLine(line.line, line.request.replace(request_id=rid)), gid)
            for line, rid, gid in zip(lines, claimed, given)]
    tally = _Tally(ids=list(claimed))
    inflight: dict[Any, _Flight] = {}
    routes: dict[str, RouteRequest] = {}  # request id -> what the router was told of it

    def dispatch(flight: _Flight) -> None:
        request = flight.item.request
        route = routes.setdefault(flight.request_id, RouteRequest(flight.request_id,
                                                                  keys(request) if keys is not None else ()))
        candidates = replicas.candidates(route)
        if not candidates:  # every replica down: wait (bounded) for one to come back
            candidates = _await_a_replica(replicas, route, config.ray.actor_start_timeout_s, progress)
        name, actor = candidates[0]
        flight.replica = name
        replicas.routed(route, name)
        inflight[actor.generate.remote(request)] = flight

    def settle(flight: _Flight, lost: bool = False) -> None:
        route = routes.pop(flight.request_id, None)
        if route is not None:
            replicas.finished(route, flight.replica, lost=lost)

    try:
        started = time.perf_counter()
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a", encoding="utf-8") as sink:
            def write(flight: _Flight, outcome: Any) -> None:
                result = outcome.to_dict() if not isinstance(outcome, dict) else outcome
                if result.get("finish_reason") == "error":  # a line that ended in error is a failed line
                    tally.failed += 1
                result["line"] = flight.item.line
                if result.get("request_id") != flight.given_id:
                    result["given_request_id"] = flight.given_id
                sink.write(json.dumps(result) + "\n")
                sink.flush()
                tally.finished += 1
                tally.tokens += result.get("metadata", {}).get("generated_tokens", 0)
                elapsed = time.perf_counter() - started
                progress(f"[{tally.finished}/{len(lines)}] line {flight.item.line} {result.get('finish_reason')} "
                         f"{tally.tokens} tokens {tally.tokens / elapsed:.1f} tok/s"
                         + (f" ({result['error']})" if result.get("finish_reason") == "error" else ""))

            while todo or inflight:
                room = config.ray.generator_max_concurrency * max(1, _replicas_up(replicas))
                while todo and len(inflight) < room:
                    item, gid = todo.pop(0)
                    dispatch(_Flight(item, gid))
                ready, _ = ray.wait(list(inflight), num_returns=1, timeout=timeout)
                for ref in ready:
                    flight = inflight.pop(ref)
                    rid = flight.item.request.request_id
                    try:
                        result = ray.get(ref, timeout=timeout)
                    except RayActorError as err:
                        settle(flight, lost=True)
                        replicas.died(flight.replica)
                        retry = _after_generator_death(topo, flight, err, run_id, timeout, progress)
                        if retry is not None:
                            replicas.rerun()
                            tally.ids.append(retry.request_id)
                            dispatch(retry)
                            continue
                        result = {"request_id": rid, "finish_reason": "error",
                                  "error": f"the generator was lost twice, or did not come back in time: {err}"}
                    except RayTaskError as err:  # this request failed (a bad value, a mod that cannot load): it alone
                        settle(flight, lost=True)
                        if isinstance(err.cause, ReplicaDrainingError):  # never started there: another replica runs it
                            replicas.draining(flight.replica)
                            dispatch(_Flight(flight.item, flight.given_id, attempt=flight.attempt))
                            continue
                        result = {"request_id": rid, "finish_reason": "error", "error": _task_error(err)}
                    else:
                        settle(flight)
                    write(flight, result)
    finally:
        replicas.close()  # its reads stop; the actors keep running
    _order_by_line(out)
    routed = replicas.stats()
    drained = [_settled(g.drain, timeout=timeout * 4) for g in replicas.handles.values()]
    _ingest_settled(topo.ingest, timeout)  # every payload sent or spooled before counting this job's
    counts = _settled(topo.store.request_counts, tally.ids, timeout=timeout) if tally.ids else {}
    ingest = _settled(topo.ingest.outcomes, tally.ids, timeout=timeout) if tally.ids else {}
    elapsed = time.perf_counter() - started
    return {
        "requests": tally.finished,
        "failed": tally.failed,
        "tokens": tally.tokens,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(tally.tokens / elapsed, 2) if elapsed else 0.0,
        "sae_rows": counts.get("activations", 0),
        "sae_blocks_missing": counts.get("missing_blocks", 0),
        "ingest_delivered": ingest.get("delivered", 0),  # this job's payloads only
        "ingest_spooled": ingest.get("spooled", 0),
        "run_id": run_id,
        "generators": drained,
        "router": {"policy": routed.policy, "reruns": replicas.reruns,
                   "decisions": [{"replica": replicas.label(name), "reason": reason, "requests": n}
                                 for (name, reason), n in sorted(routed.decisions.items())],
                   "cached_blocks": {replicas.label(name): status.cached_blocks  # as the router last read them
                                     for name, status in sorted(routed.replicas.items())}},
    }


def _order_by_line(out: Path) -> None:
    """Put the results file in input order once the job's lines are done. Lines are appended as
    requests finish (batched requests finish out of order; a killed job keeps everything written);
    this rewrite, to a temporary file renamed over the old one, only reorders them. A line that
    does not parse (torn by a killed run) stays, at the end."""
    texts = out.read_text(encoding="utf-8").splitlines() if out.is_file() else []
    keyed, torn = [], []
    for index, text in enumerate(texts):
        try:
            keyed.append((int(json.loads(text)["line"]), index, text))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            torn.append(text)
    ordered = [text for _, _, text in sorted(keyed)] + torn
    if ordered == texts:
        return
    staging = out.with_name(f".{out.name}.ordering-{uuid.uuid4().hex[:6]}")
    staging.write_text("".join(t + "\n" for t in ordered), encoding="utf-8")
    os.replace(staging, out)


def _ingest_settled(ingest: Any, timeout: float) -> dict[str, Any]:
    """The IngestActor's counts once every payload handed to it has been sent or spooled: its own
    flusher thread may be mid-send when our ``flush`` returns, so wait (bounded) for the counts."""
    stats = _settled(ingest.flush, timeout=timeout)
    deadline = time.monotonic() + timeout
    while (stats["delivered"] + stats["spooled"] + stats["dropped_without_url"] < stats["submitted"]
           and time.monotonic() < deadline):
        time.sleep(0.2)
        stats = _settled(ingest.stats, timeout=timeout)
    return stats


def _after_generator_death(topo: Any, flight: _Flight, err: Exception, run_id: str, timeout: float,
                           progress: Any) -> _Flight | None:
    """Record the dead attempt's unstored blocks as missing; the retry to run, or None (gave up)."""
    from engine.config import REQUEST_ID_MAX_CHARS

    rid = flight.item.request.request_id
    missing = _settled(topo.store.abandon_request, rid, f"generator died: {type(err).__name__}", timeout=timeout)
    progress(f"line {flight.item.line}: the generator died during {rid} ({missing} SAE block(s) recorded missing)"
             + ("; running it again" if flight.attempt == 0 else "; giving up"))
    if flight.attempt > 0:
        return None
    [retry_id] = _settled(topo.store.claim_request_ids, [f"{rid}-retry1"], run_id, REQUEST_ID_MAX_CHARS,
                          timeout=timeout)
    item = PromptLine(flight.item.line, flight.item.request.replace(request_id=retry_id))
    return _Flight(item, flight.given_id, attempt=1)


def _replicas_up(replicas: Any) -> int:
    return sum(1 for status in replicas.stats().replicas.values() if status.up and not status.draining)


def _await_a_replica(replicas: Any, route: Any, bound: float, progress: Any) -> list[tuple[str, Any]]:
    """Until a replica is up again (``max_restarts`` brings a dead one back, and it reloads its
    model first: on a GPU that takes minutes), at most ``bound`` seconds."""
    from engine.errors import NoReplicaError

    progress(f"no generator replica is up; waiting up to {bound:g} s for one to come back…")
    deadline = time.monotonic() + bound
    while (left := deadline - time.monotonic()) > 0:
        replicas.refresh(wait_s=min(left, 5.0))
        candidates = replicas.candidates(route)
        if candidates:
            return candidates
    raise NoReplicaError(f"a generator replica must come back within {bound:g} s (ray.actor_start_timeout_s), got "
                         "none; see `ray status` and the actors' logs", parameter="ray.actor_start_timeout_s",
                         value=bound)


def _job_argv(argv: Sequence[str] | None) -> list[str]:
    """``--args-from-env NAME`` alone stands for the arguments in ``$NAME`` (:func:`encode_job_args`):
    how ``raylens submit`` hands paths over without a shell ever reading them."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "--args-from-env":
        return args
    try:
        values = json.loads(base64.urlsafe_b64decode(os.environ[args[1]].encode("ascii")))
    except (KeyError, ValueError, binascii.Error):  # JSON and base64 errors are ValueErrors too
        values = None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise SystemExit(f"python -m pipelines.jobs.generate: error: `{args[1]}` must hold a base64 JSON list of "
                         "argument strings (raylens submit sets it)")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.jobs.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="raylens YAML (default configs/local.yaml or $RAYLENS_CONFIG)")
    parser.add_argument("--prompts", required=True, help="JSONL, one request per line")
    parser.add_argument("--out", required=True, help="results JSONL (appended; done lines are skipped)")
    parser.add_argument("--address", help="Ray address (default: ray.address, 'auto')")
    parser.add_argument("--workdir", help="directory that relative paths (prompts, out, store, spool) are under; "
                                          "inside `ray job submit --working-dir .` pass your own: --workdir $PWD")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(_job_argv(argv))

    from engine.config import load_job_config
    from engine.errors import RaylensError

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        base, config = load_job_config(args.config, args.workdir)
        lines = read_prompts(base / args.prompts)
        out = base / args.out
        done = _done_lines(out)
        todo = [line for line in lines if line.line not in done]
        if done:
            progress(f"resuming: {len(done)} line(s) already in {out}, {len(todo)} to go")
        from pipelines.cluster.connection import connect

        connect(config, args.address)
        summary = run(config, todo, out, progress=progress)
    except RaylensError as err:  # InputError (a bad prompts line) included
        if args.debug:
            raise
        print(f"raylens generate: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"summary": summary}), flush=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
