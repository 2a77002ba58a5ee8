"""`raylens submit` hands paths to the job without a shell reading them; no reachable cluster or
dashboard is one line and exit 2, at once."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import stat
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

HOSTILE = "my out $HOME ${HOME} $(touch PWNED) `touch PWNED2`; touch PWNED3 && echo x.jsonl"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the socket is


def submit_args(tmp_path, out: str) -> argparse.Namespace:
    return argparse.Namespace(prompts=str(tmp_path / "my prompts.jsonl"), out=out, config=None)


def _job_argv(argv, runtime_env):
    from pipelines.jobs import generate

    previous = os.environ.get("RAYLENS_JOB_ARGS")
    os.environ["RAYLENS_JOB_ARGS"] = runtime_env["env_vars"]["RAYLENS_JOB_ARGS"]
    try:
        return generate._job_argv(argv)
    finally:
        os.environ.pop("RAYLENS_JOB_ARGS")
        if previous is not None:
            os.environ["RAYLENS_JOB_ARGS"] = previous


def test_the_entrypoint_holds_no_user_value(tmp_path):
    from pipelines.cli.ray_commands import job_request
    from pipelines.jobs.generate import job_entrypoint

    entrypoint, runtime_env = job_request(submit_args(tmp_path, str(tmp_path / HOSTILE)), tmp_path / "a dir")
    assert entrypoint == job_entrypoint() and "PWNED" not in entrypoint and str(tmp_path) not in entrypoint
    assert "$" not in runtime_env["env_vars"]["RAYLENS_JOB_ARGS"]  # Ray expands $VAR in runtime_env values
    argv = _job_argv(["--args-from-env", "RAYLENS_JOB_ARGS"], runtime_env)
    assert argv[argv.index("--out") + 1] == str(tmp_path / HOSTILE)
    assert argv[argv.index("--workdir") + 1] == str(tmp_path / "a dir")


def test_the_arguments_reach_the_job_exactly_through_a_real_shell(tmp_path):
    """Run the entrypoint as Ray does (through a shell), with a stand-in `python` that records the
    arguments the job's `main` would parse; the hostile value must arrive whole and run nothing."""
    from pipelines.cli.ray_commands import job_request

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    recorder = bin_dir / "python"
    record = tmp_path / "argv.json"
    recorder.write_text(f"#!{sys.executable}\n"
                        "import json, sys\n"
                        f"sys.path.insert(0, {str(os.getcwd())!r})\n"
                        "from pipelines.jobs.generate import _job_argv\n"
                        f"open({str(record)!r}, 'w').write(json.dumps(_job_argv(sys.argv[3:])))\n")
    recorder.chmod(recorder.stat().st_mode | stat.S_IEXEC)
    out = str(tmp_path / HOSTILE)
    entrypoint, runtime_env = job_request(submit_args(tmp_path, out), tmp_path)
    # as Ray sets runtime_env variables: with $VAR expanded
    env = {**os.environ, **{k: os.path.expandvars(v) for k, v in runtime_env["env_vars"].items()},
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["/bin/sh", "-c", entrypoint], cwd=tmp_path, env=env, check=True, timeout=60)
    argv = json.loads(record.read_text())
    assert argv[argv.index("--out") + 1] == out
    assert argv[argv.index("--prompts") + 1] == str(tmp_path / "my prompts.jsonl")
    assert not list(tmp_path.glob("PWNED*")), "a value was run by the shell"
    # positive control: the same value spliced into a shell string, as entrypoints used to be, does run
    subprocess.run(["/bin/sh", "-c", f"true --out {out}"], cwd=tmp_path, check=False, timeout=60,
                   capture_output=True)
    assert list(tmp_path.glob("PWNED*")), "the control should have run the injected command"
    assert shlex.split(f"--out {tmp_path / 'a b'}") != ["--out", str(tmp_path / "a b")]  # and spaces split


def test_a_job_given_a_malformed_argument_list_says_so(monkeypatch):
    from pipelines.jobs.generate import _job_argv

    from pipelines.jobs.generate import encode_job_args

    monkeypatch.setenv("RAYLENS_JOB_ARGS", '{"not": "base64"}')
    with pytest.raises(SystemExit, match="must hold a base64 JSON list"):
        _job_argv(["--args-from-env", "RAYLENS_JOB_ARGS"])
    monkeypatch.setenv("RAYLENS_JOB_ARGS", encode_job_args(["--out", "x"])[:-4] + "%%%%")
    with pytest.raises(SystemExit, match="must hold a base64 JSON list"):
        _job_argv(["--args-from-env", "RAYLENS_JOB_ARGS"])
    assert _job_argv(["--prompts", "p", "--out", "o"]) == ["--prompts", "p", "--out", "o"]


@pytest.mark.parametrize("command", [["status", "--address", "127.0.0.1:{port}"],
                                     ["submit", "--prompts", "{prompts}", "--address", "http://127.0.0.1:{port}"],
                                     ["stop", "--address", "127.0.0.1:{port}"]])
def test_no_reachable_cluster_is_one_line_and_exit_2(tmp_path, command):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    argv = [part.format(port=closed_port(), prompts=prompts) for part in command]
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", *argv], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("raylens: error: ") and "must reach a running" in lines[0], lines


def _listener(answer: bytes | None):
    """A loopback listener that accepts connections and then either stays silent or sends ``answer``."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            if answer is not None:
                conn.recv(64)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_a_listener_that_never_answers_fails_within_the_connect_timeout():
    """The slow case: TCP connects, nothing answers; `ray.init` would wait for minutes."""
    from engine.errors import ClusterUnreachableError
    from pipelines.cluster.connection import probe_address

    silent = _listener(None)
    answering = _listener(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # an HTTP/2 SETTINGS frame, as gRPC sends
    try:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(ClusterUnreachableError, match=r"`ray.address` must reach a running Ray cluster, got .*"
                                                          r"no answer; waited at most 0.5s"):
            probe_address(address, 0.5, what="Ray cluster", key="ray.address")
        probe_address(f"127.0.0.1:{answering.getsockname()[1]}", 5, what="Ray cluster", key="ray.address")  # control
    finally:
        silent.close()
        answering.close()


def test_auto_is_resolved_to_the_address_it_means_and_probed_like_an_explicit_one(monkeypatch):
    """``ray.address: auto`` with a stale record (here RAY_ADDRESS naming a port nobody answers
    on) is one line within the connect timeout, never minutes of ``ray.init`` retries."""
    import dataclasses
    import socket

    from engine.errors import ClusterUnreachableError
    from pipelines.cluster.connection import connect, resolve_auto
    from tests.helpers import build_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # closed once the block ends
    monkeypatch.setenv("RAY_ADDRESS", dead)
    assert resolve_auto("auto") == dead and resolve_auto("10.0.0.1:6379") == "10.0.0.1:6379"
    cfg = build_config()
    cfg = dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, address="auto", connect_timeout_s=1.0))
    with pytest.raises(ClusterUnreachableError, match=rf"got '{dead}'"):
        connect(cfg)
