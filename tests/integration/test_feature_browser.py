"""The feature browser page in headless Chromium, over a store with known rows and no model.

Chromium is driven over the DevTools protocol (the viewer test's client) and the test waits on
the page's own markers (``<body data-feature>``, ``<body data-request>``), never on time: search a
feature, check its top context, histogram and firing rate, click through to the request, check the
tokens coloured by the feature and the request's features ranked by specificity, dense ones
flagged. The screenshot is kept under ``artifacts/``.
"""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from engine.services.store import ActivationStore
from tests.feature_rows import FEATURE_7, fill_store, token_count
from tests.helpers import REPO
from tests.integration.test_serve_viewer import _Cdp, browser  # noqa: F401  (the fixture is used by name)

pytestmark = pytest.mark.slow

SCREENSHOT = REPO / "artifacts" / "feature-browser.png"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pipelines.serve.app import build_browser_app
    from pipelines.serve.local import serve_in_thread
    from tests.feature_rows import TOK

    path = tmp_path_factory.mktemp("browser") / "activations.duckdb"
    with ActivationStore(path, threads=1) as store:
        fill_store(store)
    with ActivationStore(path, read_only=True) as store, \
            serve_in_thread(build_browser_app(store, tokenizer=TOK, neuronpedia_url="https://np.example")) as url:
        yield url


def _until(condition: str) -> str:
    """A promise that resolves once ``condition`` (a JS expression) holds, re-checked on every DOM change."""
    return f"""new Promise((resolve) => {{
        const ready = () => {{ try {{ return {condition}; }} catch (e) {{ return false; }} }};
        if (ready()) return resolve(true);
        new MutationObserver(() => ready() && resolve(true))
          .observe(document.documentElement, {{attributes: true, childList: true, subtree: true}});
    }})"""


async def _drive(endpoint: str, url: str) -> dict:
    import websockets

    async with websockets.connect(endpoint, max_size=None) as ws:
        cdp = _Cdp(ws)
        target = (await cdp.call("Target.createTarget", url="about:blank"))["targetId"]
        session = (await cdp.call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]

        async def evaluate(expression: str, await_promise: bool = False, timeout: float = 60):
            reply = await asyncio.wait_for(cdp.call("Runtime.evaluate", session, expression=expression,
                                                    awaitPromise=await_promise, returnByValue=True), timeout)
            assert "exceptionDetails" not in reply, reply
            return reply["result"].get("value")

        await cdp.call("Page.enable", session)
        await cdp.call("Page.navigate", session, url=url)
        await asyncio.wait_for(cdp.event("Page.loadEventFired"), 60)
        await evaluate(_until('document.body.dataset.ready === "true"'), True)
        # search feature 7 as a user would: type the id, press the button
        await evaluate('document.getElementById("feature-id").value = "7"; document.getElementById("show").click()')
        await evaluate(_until('document.body.dataset.feature === "7" || !!document.body.dataset.error'), True)
        feature = json.loads(await evaluate("""JSON.stringify((() => {
            const first = document.querySelector("#contexts tbody tr");
            return {
              error: document.body.dataset.error || null,
              rows: document.querySelectorAll("#contexts tbody tr").length,
              highlighted: first.querySelector(".hl").textContent,
              context: first.querySelector(".ctx").textContent,
              activation: first.querySelector(".act").textContent,
              request: first.querySelector(".rid").textContent,
              frequency: document.getElementById("frequency").textContent,
              bars: [...document.querySelectorAll("#histogram .bar")].map((b) => Number(b.dataset.count)),
              neuronpedia: [...document.querySelectorAll("#neuronpedia a")].map((a) => a.href),
            };
        })())"""))
        # click through to the request of the top context
        await evaluate('document.querySelector("#contexts tbody tr").click()')
        await evaluate(_until('document.body.dataset.request === "req-cat" || !!document.body.dataset.error'), True)
        request = json.loads(await evaluate("""JSON.stringify((() => {
            const tokens = [...document.querySelectorAll("#request-tokens .tok")];
            return {
              error: document.body.dataset.error || null,
              text: tokens.map((t) => t.textContent).join(""),
              coloured: tokens.filter((t) => t.style.background).map((t) => t.textContent),
              rows: document.querySelectorAll("#token-features tbody tr").length,
              ranked: [...document.querySelectorAll("#request-features tbody tr")].map((r) => [
                r.querySelector(".feat").textContent, !!r.querySelector(".dense-badge")]),
              greyed: [...new Set([...document.querySelectorAll("#token-features .feat.dense")]
                .map((f) => f.textContent))],
              url: location.search,
            };
        })())"""))
        shot = await cdp.call("Page.captureScreenshot", session, format="png")
        await cdp.call("Target.closeTarget", targetId=target)
        return {"feature": feature, "request": request, "png": base64.b64decode(shot["data"])}


def test_search_a_feature_then_click_through_to_its_request(server, browser):  # noqa: F811
    state = asyncio.run(_drive(browser, f"{server}/features"))
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    SCREENSHOT.write_bytes(state["png"])
    feature, request = state["feature"], state["request"]
    assert feature["error"] is None, feature
    assert feature["rows"] == len(FEATURE_7)
    assert feature["highlighted"] == "c" and feature["activation"] == "9.500" and feature["request"] == "req-cat"
    assert feature["context"] == "The cat sat o"  # up to 8 tokens either side of the highlighted "c"
    assert feature["frequency"].startswith(f"fires on {len(FEATURE_7)} of {token_count()} stored tokens")
    assert sum(feature["bars"]) == len(FEATURE_7) and len(feature["bars"]) == 20
    assert feature["neuronpedia"] == ["https://np.example/llama3.1-8b/12-llamascope-res-32k/7"]
    assert request["error"] is None, request
    assert request["text"] == "The cat sat on the mat."
    assert request["coloured"] == ["c", "m"]  # the tokens where feature 7 fired, in order
    assert request["rows"] == len("The cat sat on the mat.")
    # the request's features, most specific first: 7 fires at 3 tokens, 3 at every one (dense, flagged)
    assert request["ranked"] == [["7", False], ["3", True]] and request["greyed"] == ["3"]
    assert "feature=7" in request["url"] and "request=req-cat" in request["url"]
    assert SCREENSHOT.stat().st_size > 1000
