"""``raylens serve``'s SIGTERM path without a cluster: the handler is in place before the deploy
returns, because Serve's proxy answers (and an operator may stop the server) while ``serve.run`` is
still waiting on the app's status; a SIGTERM then still drains, cancels and returns 0."""

from __future__ import annotations

import os
import signal

import pytest

from engine.config import RaylensConfig
from pipelines.serve import deployment
from pipelines.serve.settings import ServeSettings


@pytest.fixture
def no_cluster(monkeypatch):
    from ray import serve

    calls: list[str] = []
    monkeypatch.setattr(deployment, "ensure_ray", lambda config, address: calls.append("ray"))
    monkeypatch.setattr(deployment, "_cancel_streams", lambda config: calls.append("cancel") or 2)
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(f"delete {name}"))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("shutdown"))
    # a recorder as the process's own handler: a regression fails this test instead of killing pytest
    previous = signal.signal(signal.SIGTERM, lambda *_: calls.append("SIGTERM reached the old handler"))
    try:
        yield calls
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_during_the_deploy_still_shuts_down_gracefully(no_cluster, monkeypatch, capsys):
    before = signal.getsignal(signal.SIGTERM)

    def deploy_then_get_stopped(config, settings):
        assert signal.getsignal(signal.SIGTERM) is not before, "no SIGTERM handler of the server's during the deploy"
        os.kill(os.getpid(), signal.SIGTERM)  # the operator stops it while serve.run still waits
        no_cluster.append("deployed")
        return "http://127.0.0.1:1"

    monkeypatch.setattr(deployment, "deploy", deploy_then_get_stopped)
    rc = deployment.serve_forever(RaylensConfig(), ServeSettings(shutdown_grace_s=1.0))
    assert rc == 0
    assert no_cluster == ["ray", "deployed", f"delete {deployment.APP_NAME}", "cancel", "shutdown"]
    err = capsys.readouterr().err
    assert "requests in flight have 1 s to finish" in err and "2 stream(s) still running were cancelled" in err
    assert signal.getsignal(signal.SIGTERM) == before  # the process's own handler is back


def test_a_failed_deploy_puts_the_sigterm_handler_back(no_cluster, monkeypatch):
    before = signal.getsignal(signal.SIGTERM)

    def deploy_fails(config, settings):
        raise RuntimeError("the app did not start")

    monkeypatch.setattr(deployment, "deploy", deploy_fails)
    with pytest.raises(RuntimeError, match="did not start"):
        deployment.serve_forever(RaylensConfig(), ServeSettings())
    assert signal.getsignal(signal.SIGTERM) == before
