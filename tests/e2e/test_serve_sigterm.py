"""``raylens serve`` as an operator runs it, stopped with SIGTERM while a stream is in flight: it stops
taking requests, gives the stream ``--shutdown-grace-s`` to finish, cancels it on the generator when
it has not, and exits 0 — bounded, never a hang, and the generator is left with nothing running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.e2e.conftest import free_port, kill_namespace_actors, ray_config, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
GRACE_S = 3.0
REPO = Path(__file__).resolve().parents[2]


def test_sigterm_with_a_stream_in_flight_drains_cancels_and_exits(ray_head, tmp_path):
    import httpx
    import ray
    import yaml

    from pipelines.cluster.actor_specs import actor_roles

    config = ray_config(tmp_path, address=ray_head.address)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve", "--config", str(path), "--address",
                                 ray_head.address, "--port", str(port), "--shutdown-grace-s", str(GRACE_S),
                                 "--max-new-tokens", "4096"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    seen: list[str] = []
    ended = threading.Event()
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"`raylens serve` exited early: {log.read_text()[-3000:]}")
            try:
                return httpx.get(f"{url}/healthz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=600, interval=1.0, what="`raylens serve` to answer")
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]

        def stream() -> None:  # far more tokens than the grace period lets it generate here
            body = {"model": model, "messages": [{"role": "user", "content": "Count slowly to one thousand."}],
                    "max_tokens": 3000, "stream": True, "temperature": 0, "ignore_eos": True}
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
                    for line in response.iter_lines():
                        seen.append(line)
            except httpx.HTTPError as err:  # the server went away mid-stream: an end, not a hang
                seen.append(f"closed: {type(err).__name__}")
            finally:
                ended.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        wait_until(lambda: sum(1 for line in seen if line.startswith("data: {")) >= 3, timeout=300,
                   what="the stream's first tokens")
        generator = ray.get_actor(actor_roles(config)["raylens-generator"], namespace=config.ray.namespace)
        assert ray.get(generator.stats.remote(), timeout=60)["streaming"] == 1  # positive control
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=GRACE_S + 180)  # the grace period, Serve's own shutdown and the print
        assert rc == 0, log.read_text()[-3000:]
        assert ended.wait(60), "the client's stream hung after the server stopped"
        assert not any(line.startswith("data: [DONE]") for line in seen), "positive control: it was cut, not done"
        wait_until(lambda: ray.get(generator.stats.remote(), timeout=60)["streaming"] == 0, timeout=120,
                   what="the generator to end the stream nobody reads")
        text = log.read_text()
        assert "requests in flight have 3 s to finish" in text and "stream(s) still running were cancelled" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        kill_namespace_actors(config)
