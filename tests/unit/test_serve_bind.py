"""``raylens serve`` and ``raylens browse`` on a non-loopback host refuse to start without an API
key (one line, exit 2, before any cluster or model is touched) unless ``--insecure-no-auth``."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("command", ["serve", "browse"])
def test_a_non_loopback_bind_without_a_key_is_refused_in_one_line(command, monkeypatch, capsys):
    from pipelines.cli import main

    monkeypatch.delenv("RAYLENS_API_KEY", raising=False)
    assert main([command, "--host", "0.0.0.0", "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert "must come with an API key" in err and "--insecure-no-auth" in err and "Traceback" not in err
    assert err.strip().count("\n") == 0


def test_the_insecure_flag_is_explicit_and_loud():
    from pipelines.serve.settings import ServeSettings

    settings = ServeSettings(host="0.0.0.0", insecure_no_auth=True)
    assert any("NO authentication" in note and "--insecure-no-auth" in note for note in settings.startup_warnings())
