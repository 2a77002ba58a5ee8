"""The viewer page in headless Chromium: load it, run a short generation, check what it drew.

Chromium is driven over the DevTools protocol (a WebSocket) so the test waits on the page's own
"done" marker instead of sleeping; the screenshot is kept under ``artifacts/``.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = REPO / "artifacts" / "serve-viewer.png"


@pytest.fixture(scope="module")
def server(engine):
    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    with serve_in_thread(build_app(engine, ServeSettings(max_new_tokens=32, request_timeout_s=120))) as url:
        yield url


@pytest.fixture
def browser(tmp_path):
    """Headless Chromium with remote debugging on a free loopback port; killed at the end."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs it where apt is available)")
    profile = tmp_path / "profile"
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "--window-size=1100,900",
         "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # Chromium announces its DevTools endpoint on stderr once listening
            if "DevTools listening on" in line:
                yield line.split("DevTools listening on", 1)[1].strip()
                break
        else:
            pytest.fail(f"chromium exited ({proc.wait(10)}) without opening DevTools")
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.poll() is not None, "chromium must be gone after the test"


class _Cdp:
    def __init__(self, ws):
        self.ws, self.ids, self.events = ws, itertools.count(1), []

    async def event(self, method):
        """Wait for the next event named ``method`` (events that came during calls are kept)."""
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method:
                    return self.events.pop(i)
            self.events.append(json.loads(await self.ws.recv()))

    async def call(self, method, session=None, **params):
        call_id = next(self.ids)
        message = {"id": call_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        await self.ws.send(json.dumps(message))
        while True:
            reply = json.loads(await self.ws.recv())
            if "method" in reply:
                self.events.append(reply)
            elif reply.get("id") == call_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply["result"]


async def _drive(endpoint: str, url: str) -> dict:
    import websockets

    async with websockets.connect(endpoint, max_size=None) as ws:
        cdp = _Cdp(ws)
        target = (await cdp.call("Target.createTarget", url="about:blank"))["targetId"]
        session = (await cdp.call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]
        await cdp.call("Page.enable", session)
        await cdp.call("Page.navigate", session, url=url)
        await asyncio.wait_for(cdp.event("Page.loadEventFired"), 60)
        done = """new Promise((resolve) => {
            const ready = () => document.body && document.body.dataset.done === "true";
            if (ready()) return resolve(true);
            new MutationObserver(() => ready() && resolve(true))
              .observe(document.documentElement, {attributes: true, subtree: true});
        })"""
        # the page runs one generation on its own (?autorun=1) and marks <body data-done> at the end
        await asyncio.wait_for(cdp.call("Runtime.evaluate", session, expression=done, awaitPromise=True), 400)
        probe = """(() => {
            const canvas = document.getElementById("heatmap");
            const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
            let painted = 0;
            for (let i = 3; i < pixels.length; i += 4) if (pixels[i] > 0) painted++;
            return JSON.stringify({
              generated: document.querySelectorAll("#tokens .tok.gen").length,
              coloured: [...document.querySelectorAll("#tokens .tok")].filter((s) => s.style.background).length,
              rows: Number(canvas.dataset.rows || 0), painted,
              status: document.getElementById("status").textContent,
              model: document.getElementById("model").textContent,
            });
        })()"""
        evaluated = await cdp.call("Runtime.evaluate", session, expression=probe)
        assert "value" in evaluated["result"], f"the page probe failed: {evaluated}"
        state = json.loads(evaluated["result"]["value"])
        shot = await cdp.call("Page.captureScreenshot", session, format="png")
        state["png"] = base64.b64decode(shot["data"])
        await cdp.call("Target.closeTarget", targetId=target)
        return state


def test_viewer_streams_tokens_and_paints_the_attention_heatmap(server, browser, engine):
    state = asyncio.run(_drive(browser, f"{server}/?autorun=1&max_tokens=8"))
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    SCREENSHOT.write_bytes(state.pop("png"))
    assert state["status"].startswith("done"), state
    assert state["generated"] > 0, f"no generated tokens rendered: {state}"
    assert state["rows"] == state["generated"], f"one heatmap row per generated token: {state}"
    assert state["painted"] > 0 and state["coloured"] > 0, f"heatmap not painted: {state}"
    assert engine.backend.info.model_id in state["model"]
    assert SCREENSHOT.stat().st_size > 1000
