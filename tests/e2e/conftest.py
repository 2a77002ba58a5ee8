"""A real local Ray head on 127.0.0.1 per test module, stopped at the end.

The head runs in its own temp dir with the dashboard (Jobs API) on loopback, a small CPU count,
and every raylens actor in a namespace of its own, so modules never see each other's actors.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import build_config

os.environ.setdefault("RAY_allow_out_of_band_object_ref_serialization", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


#: Where free_port looks: above Ray's worker ports (10002-19999 by default), below the kernel's
#: ephemeral range (read from /proc where there is one).
_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port free now, for a server a test starts. Not one the kernel hands out (bind to
    0): that range is also where every outgoing connection takes its local port, and a head's
    processes open many between this check and the server's bind (seen: the dashboard's port
    taken, `ray start` exiting with "address already in use")."""
    low = _ephemeral_low()
    if low - _PORTS_FROM >= 1000:
        for _ in range(100):
            port = random.randrange(_PORTS_FROM, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


@dataclasses.dataclass
class Head:
    address: str
    dashboard_url: str
    temp_dir: Path


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A ``ray start --head --block`` process of this module's own, in its own process group:
    signalling it stops exactly the head this module started and no other Ray on the machine
    (other test runs' included)."""
    import ray

    temp_dir = Path("/tmp") / f"rl-{uuid.uuid4().hex[:6]}"  # short: Ray's socket paths have a length limit
    port, dash = free_port(), free_port()
    # as with an activated venv: jobs run `python …` from the head's PATH
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [_ray_cli(), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
           "--num-cpus", "8", "--num-gpus", "0", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
           "--include-dashboard", "true", "--temp-dir", str(temp_dir), "--disable-usage-stats"]
    log = tmp_path_factory.mktemp("ray-head") / "ray-start.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    head = Head(f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}", temp_dir)
    try:
        _wait_for_head(proc, head, log)
        ray.init(address=head.address, log_to_driver=False)
        gcs = ray.get_runtime_context().gcs_address
        assert gcs.startswith("127.0.0.1:"), f"Ray must stay on loopback in tests, but its GCS is at {gcs}"
        yield head
    finally:
        ray.shutdown()
        _stop_head(proc)


def _wait_for_head(proc: subprocess.Popen, head: Head, log: Path, timeout: float = 180.0) -> None:
    """Until the head's dashboard (the Jobs API) answers; the head exiting first is a failure."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"`ray start --head` exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{head.dashboard_url}/api/version", timeout=2):
                return
        except urllib.error.HTTPError:  # it answers (401 without the tests' Ray auth token): it is up
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the Ray head did not answer within {timeout} s: {log.read_text()[-2000:]}")


def _stop_head(proc: subprocess.Popen) -> None:
    """SIGTERM to ``ray start --block`` alone (it drains and stops the processes it started), then
    SIGKILL to whatever is left of its process group — this head's processes, no one else's."""
    import signal

    proc.terminate()
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def ray_config(tmp_path: Path, *, ingest_url: str | None = None, **ray_overrides):
    """The local config with the committed SAE on, a private store and namespace. Every path is
    absolute, as a job makes them: the actors are keyed by the config they hold, and a job reading
    this config from a file must find the test's own actors."""
    cfg = build_config()
    return dataclasses.replace(
        cfg,
        activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(tmp_path / "store.duckdb"),
                                        parquet_path=str(tmp_path / "parquet")),
        sae=dataclasses.replace(cfg.sae, enabled=True, block_steps=2),
        ingest=dataclasses.replace(cfg.ingest, url=ingest_url, retries=1, timeout_s=2.0,
                                   spool_dir=str(tmp_path / "spool")),
        ray=dataclasses.replace(cfg.ray, **{"namespace": f"raylens-test-{uuid.uuid4().hex[:8]}", "sae_workers": 2,
                                            "sae_worker_num_cpus": 1, "max_inflight_blocks": 4,
                                            "ingest_flush_interval_s": 0.5, "call_timeout_s": 120, **ray_overrides}),
    )


def kill_namespace_actors(config) -> None:
    """Detached actors outlive drivers: remove a test's actors explicitly, and wait (bounded) until
    Ray no longer lists them, so the next test starts on a head whose CPUs they no longer hold."""
    from pipelines.cluster.actor_specs import actor_names
    from pipelines.cluster.ending import end_named_actors

    end_named_actors(config.ray.namespace, actor_names(config), timeout_s=60)


def end_namespace(namespace: str, *, timeout_s: float = 120.0) -> None:
    """Every actor of a test's own namespace (scaled replicas included) ended; fails when Ray
    still lists one after ``timeout_s``."""
    from pipelines.cluster.ending import end_named_actors, listed_names

    left = end_named_actors(namespace, sorted(listed_names(namespace)), timeout_s=timeout_s)
    assert not left, f"the actors {left} of {namespace} did not end within {timeout_s:g} s"


def wait_until(predicate, *, timeout: float = 120.0, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
