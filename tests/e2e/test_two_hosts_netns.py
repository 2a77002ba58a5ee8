"""Two hosts across a real network: the Ray head here, the SAE box in a network namespace.

Each host also offers one ``gen_slot``: with ``ray.generator_resource: gen_slot`` and two
generator replicas, one replica runs on each host, and the replica router (a job's) reads the
far replica's cache events across the veth.

A veth pair joins this machine's root network namespace (the head, its driver and the generator,
on the pair's first address) to a namespace of the test's own (the second node, on the other
address, the only node offering ``sae_gpu``), so every byte between the SAE workers and the head
— the hidden-state blocks, the rows for the store, Ray's control traffic — crosses an interface
that is not loopback. Two things must hold: a job's SAE rows land in the store on the head; and
when the SAE node is lost in the middle of a job (its ``ray start --block`` process group
killed), the blocks that could not be encoded are recorded as missing, and no generation result
is lost.

Skips (with the reason) where network namespaces cannot be made: not root, no ``ip``, or a
kernel/container that refuses ``ip netns add``. Every process the test starts is stopped by
signalling exactly it (its process group); the namespace and the veth pair are deleted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.conftest import kill_namespace_actors, ray_config, wait_until

pytestmark = pytest.mark.timeout(900)

PROMPTS = ["Tell me about dragons", "Describe a lighthouse at night", "Explain how bread rises",
           "Write about a long train journey", "What makes a good teacher?", "Describe the sea in winter"]


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


def _namespaces_unavailable() -> str | None:
    """Why this machine cannot build the two hosts (None: it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`, which is not installed"
    return None


@dataclasses.dataclass
class Hosts:
    namespace: str
    head_ip: str
    sae_ip: str
    head_address: str
    temp_dir: Path
    head: subprocess.Popen
    sae_node: subprocess.Popen
    sae_node_id: str


def _make_link(namespace: str, host_if: str, ns_if: str, head_ip: str, sae_ip: str) -> None:
    """A namespace and a veth pair into it, both ends up, a /24 between them; a failing step
    skips the test, naming the command and the kernel's answer."""
    steps = [("ip", "netns", "add", namespace),
             ("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if),
             ("ip", "link", "set", ns_if, "netns", namespace),
             ("ip", "addr", "add", f"{head_ip}/24", "dev", host_if),
             ("ip", "link", "set", host_if, "up"),
             ("ip", "netns", "exec", namespace, "ip", "addr", "add", f"{sae_ip}/24", "dev", ns_if),
             ("ip", "netns", "exec", namespace, "ip", "link", "set", ns_if, "up"),
             ("ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up")]
    for step in steps:
        done = _run(*step)
        if done.returncode != 0:
            pytest.skip(f"network namespaces are unavailable here: `{' '.join(step)}` failed: {done.stderr.strip()}")


def _remove_link(namespace: str, host_if: str) -> None:
    _run("ip", "link", "del", host_if)  # deleting one end deletes the pair
    _run("ip", "netns", "del", namespace)


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _ray_start(argv: list[str], log: Path, *, namespace: str | None = None) -> subprocess.Popen:
    """``ray start … --block`` in a process group of its own (inside ``namespace`` when given),
    so signalling the group stops exactly this node's processes."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    # the tests' loopback-only switch (tests/conftest.py) would refuse a node on another address
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [ray_cli, "start", "--block", "--disable-usage-stats", *argv]
    if namespace is not None:
        cmd = ["ip", "netns", "exec", namespace, *cmd]  # `ip netns exec` execs the command: same pid
    with log.open("wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen, *, grace: float) -> None:
    """SIGTERM to the ``ray start --block`` process (it stops what it started), then SIGKILL to
    what is left of its own process group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass


def _wait_for_port(ip: str, port: int, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"`ray start --head` exited with {proc.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((ip, port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"the Ray head did not listen on {ip}:{port} within {timeout} s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    import ray

    tag = secrets.token_hex(3)
    namespace, host_if, ns_if = f"rl-sae-{tag}", f"rlh{tag}", f"rls{tag}"
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250) + 1}"
    head_ip, sae_ip = f"{subnet}.1", f"{subnet}.2"
    logs = tmp_path_factory.mktemp("two-hosts")
    temp_dir = Path("/tmp") / f"rl-{uuid.uuid4().hex[:6]}"  # short: Ray's socket paths have a length limit
    _make_link(namespace, host_if, ns_if, head_ip, sae_ip)
    started: list[subprocess.Popen] = []
    try:
        port = _free_port(head_ip)
        head = _ray_start(["--head", "--node-ip-address", head_ip, "--port", str(port), "--num-cpus", "4",
                           "--num-gpus", "0", "--include-dashboard", "false", "--temp-dir", str(temp_dir),
                           "--resources", json.dumps({"gen_slot": 1})], logs / "head.log")
        started.append(head)
        _wait_for_port(head_ip, port, head, logs / "head.log")
        address = f"{head_ip}:{port}"
        sae_node = _ray_start(["--address", address, "--node-ip-address", sae_ip, "--num-cpus", "3", "--num-gpus", "0",
                               "--resources", json.dumps({"sae_gpu": 2, "gen_slot": 1})], logs / "sae-node.log",
                              namespace=namespace)
        started.append(sae_node)
        ray.init(address=address, log_to_driver=False, _node_ip_address=head_ip)  # the driver is on the head

        def sae_node_alive():
            if sae_node.poll() is not None:
                raise AssertionError(f"the SAE node's `ray start` exited: {(logs / 'sae-node.log').read_text()[-2000:]}")
            return next((n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("sae_gpu")), None)

        node_id = wait_until(sae_node_alive, timeout=180, interval=0.5, what="the SAE node to join from its namespace")
        yield Hosts(namespace, head_ip, sae_ip, address, temp_dir, head, sae_node, node_id)
    finally:
        ray.shutdown()
        for proc in reversed(started):
            _stop(proc, grace=60)
        _remove_link(namespace, host_if)


def _config(tmp_path: Path):
    """The e2e config with SAE workers only where ``sae_gpu`` is, small blocks (many of them) and
    short bounds, so a lost node is noticed in seconds."""
    config = ray_config(tmp_path, sae_worker_resource="sae_gpu", sae_workers=2, max_inflight_blocks=4,
                        call_timeout_s=60)
    return dataclasses.replace(config, sae=dataclasses.replace(config.sae, block_steps=2, retry_attempts=2,
                                                               retry_backoff_s=0.05))


def _prompts(tmp_path: Path, tag: str, max_tokens: int) -> Path:
    path = tmp_path / f"{tag}.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                        "request_id": f"{tag}-{i}"}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


def test_sae_rows_cross_the_veth_and_land_in_the_store_on_the_head(hosts, tmp_path):
    import ray

    from pipelines.cluster.topology import build_topology
    from pipelines.jobs.generate import read_prompts, run

    config = _config(tmp_path)
    try:
        topo = build_topology(config)
        workers = {ray.get(w.node_id.remote(), timeout=300) for w in topo.sae_workers}
        assert workers == {hosts.sae_node_id}, "SAE workers must run in the namespace, the only node with sae_gpu"
        head_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == hosts.head_ip}
        sae_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == hosts.sae_ip}
        assert sae_nodes == {hosts.sae_node_id} and head_nodes and not head_nodes & sae_nodes
        summary = run(config, read_prompts(_prompts(tmp_path, "netns", 12)), tmp_path / "r.jsonl",
                      progress=lambda line: None)
        assert summary["requests"] == len(PROMPTS) and summary["failed"] == 0
        assert summary["sae_rows"] > 0 and summary["sae_blocks_missing"] == 0
        rows = ray.get(topo.store.sql.remote("SELECT count(*) FROM activations WHERE request_id LIKE 'netns-%'"),
                       timeout=120)
        assert rows == [(summary["sae_rows"],)]
    finally:
        kill_namespace_actors(config)


def test_one_generator_replica_per_host_and_the_router_reads_both(hosts, tmp_path):
    """``ray.generators: 2`` with ``generator_resource: gen_slot`` (one unit per host): a replica on
    each host; a job's requests share two system prompts, both replicas serve them, and the job's
    router reads what each one cached — the far one's cache events across the veth."""
    import ray

    from pipelines.bench.chat_workload import chats, interleaved, system_prompt
    from pipelines.cluster.topology import build_topology
    from pipelines.jobs.generate import read_prompts, run

    config = ray_config(tmp_path, generators=2, generator_resource="gen_slot", generator_num_cpus=1,
                        generator_max_concurrency=2, call_timeout_s=120)
    config = dataclasses.replace(config, sae=dataclasses.replace(config.sae, enabled=False))
    systems = [system_prompt(0, words=150), system_prompt(1, words=150)]
    order = interleaved(chats(2, 4, 1, seed=3), run=2)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c.prompt(0, systems[c.system]), "max_tokens": 2, "temperature": 0,
                                        "request_id": f"host-{i}"}) + "\n" for i, c in enumerate(order)))
    try:
        topo = build_topology(config)
        nodes = {ray.get(g.routing_report.remote(), timeout=300).node_id: g for g in topo.generators}
        assert set(nodes) == {hosts.sae_node_id, *(n["NodeID"] for n in ray.nodes()
                                                   if n["Alive"] and n["NodeManagerAddress"] == hosts.head_ip)}, \
            "the two replicas must run one on each host"
        summary = run(config, read_prompts(path), tmp_path / "out.jsonl", progress=lambda line: None)
        assert summary["requests"] == len(order) and summary["failed"] == 0, summary
        served = {node: ray.get(g.stats.remote(), timeout=120)["requests"] for node, g in nodes.items()}
        assert all(n > 0 for n in served.values()), f"each host's replica must serve requests: {served}"
        hits = {node: ray.get(g.metrics.remote(), timeout=120).prefix_cache_hits for node, g in nodes.items()}
        assert sum(hits.values()) > 0, f"the shared system prompts must be reused: hits {hits}"
        seen = summary["router"]["cached_blocks"]
        assert sorted(seen) == ["0", "1"] and all(n > 0 for n in seen.values()), \
            f"the router must have read both replicas' cached blocks, the far one's across the veth: {seen}"
    finally:
        kill_namespace_actors(config)


def test_losing_the_sae_node_mid_job_records_missing_blocks_and_loses_no_result(hosts, tmp_path):
    import ray

    from pipelines.cluster.topology import build_topology
    from pipelines.jobs.generate import read_prompts, run

    config = _config(tmp_path)
    out = tmp_path / "results.jsonl"
    outcome: dict = {}
    try:
        topo = build_topology(config)
        assert {ray.get(w.node_id.remote(), timeout=300) for w in topo.sae_workers} == {hosts.sae_node_id}
        lines = read_prompts(_prompts(tmp_path, "lost", 48))

        def job() -> None:
            try:
                outcome["summary"] = run(config, lines, out, progress=lambda line: None)
            except BaseException as err:  # noqa: BLE001 - reported by the test thread
                outcome["error"] = err

        thread = threading.Thread(target=job, daemon=True)
        thread.start()

        def some_rows_stored():
            if not thread.is_alive():
                raise AssertionError(f"the job ended before any SAE row was stored: {outcome}")
            return ray.get(topo.store.sql.remote("SELECT count(*) FROM activations WHERE request_id LIKE 'lost-%'"),
                           timeout=60)[0][0]

        before_loss = wait_until(some_rows_stored, timeout=300, interval=0.5, what="the first SAE rows")
        assert thread.is_alive(), "the job must still be running when the SAE node is lost"
        os.killpg(hosts.sae_node.pid, signal.SIGKILL)  # the SAE box is lost: its raylet and workers with it
        hosts.sae_node.wait(60)
        thread.join(600)
        assert not thread.is_alive(), "the job must end after losing its SAE node"
        assert "error" not in outcome, f"the job failed: {outcome.get('error')!r}"
        summary = outcome["summary"]
        results = [json.loads(line) for line in out.read_text().splitlines()]
        assert sorted(r["line"] for r in results) == list(range(1, len(PROMPTS) + 1)), "every line has its result"
        assert summary["requests"] == len(PROMPTS) and summary["failed"] == 0, summary
        assert all(r["finish_reason"] != "error" and r["metadata"]["generated_tokens"] == 48 for r in results), results
        assert summary["sae_blocks_missing"] > 0, f"blocks after the loss must be recorded missing: {summary}"
        assert summary["sae_rows"] >= before_loss > 0, "rows stored before the loss stay in the store"
        reasons = ray.get(topo.store.sql.remote("SELECT reason FROM missing_blocks WHERE request_id LIKE 'lost-%'"),
                          timeout=120)
        assert len(reasons) == summary["sae_blocks_missing"] and all(reason for (reason,) in reasons), reasons
    finally:
        kill_namespace_actors(config)

