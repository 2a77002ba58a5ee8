// raylens feature browser: a feature's top contexts, histogram and firing rate, and a request's
// tokens coloured by a feature, over the read-only /api/v1/features and /api/v1/requests routes.
// No build step, no dependencies. An API key in this page's URL (?api_key=…) is passed on.
// Markers for scripts and tests: <body data-feature="id"> and <body data-request="id"> once drawn.
"use strict";

const params = new URLSearchParams(location.search);
const apiKey = params.get("api_key");
const $ = (id) => document.getElementById(id);
const state = { feature: null, request: null };

function withKey(path) {
  return apiKey ? `${path}${path.includes("?") ? "&" : "?"}api_key=${encodeURIComponent(apiKey)}` : path;
}

async function api(path) {
  const response = await fetch(withKey(path));
  const data = await response.json();
  if (!response.ok) throw new Error(`${data.error_code || response.status}: ${data.error || JSON.stringify(data)}`);
  return data;
}

function el(tag, props = {}, children = []) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else node[key] = value;
  }
  for (const child of children) node.append(child);
  return node;
}

const fmt = (x) => (x === null || x === undefined ? "–" : Number(x).toPrecision(4));
const tokenText = (t) => (t.text === null || t.text === undefined ? `#${t.token_id}` : t.text);

function setStatus(text) { $("status").textContent = text; }

function syncUrl() {
  const next = new URLSearchParams();
  if (apiKey) next.set("api_key", apiKey);
  if (state.feature !== null) next.set("feature", state.feature);
  if (state.request !== null) next.set("request", state.request);
  history.replaceState(null, "", `${location.pathname}?${next}`);
}

function featureLink(id, dense = false) {
  return el("span", {
    className: dense ? "feat dense" : "feat", textContent: `${id}`, onclick: () => showFeature(id),
    title: dense ? "dense: fires on most stored tokens" : "",
  });
}

const denseBadge = () => el("span", { className: "dense-badge", textContent: "dense" });

async function showFeature(id) {
  id = Number(id);
  $("feature-id").value = id;
  setStatus(`loading feature ${id}…`);
  try {
    const data = await api(`/api/v1/features/${id}?limit=${Number($("limit").value) || 20}`);
    state.feature = id;
    drawFeature(data);
    setStatus(data.tokens_fired ? `feature ${id}` : `feature ${id} never fired in this store`);
    document.body.dataset.feature = String(id);
    if ($("colour-feature").value === "") $("colour-feature").value = id;
    syncUrl();
  } catch (err) {
    setStatus(`error: ${err.message}`);
    document.body.dataset.error = err.message;
  }
}

function drawFeature(data) {
  $("feature").hidden = false;
  $("feature-title").textContent = `#${data.feature_id}`;
  const links = $("neuronpedia");
  links.replaceChildren(...data.neuronpedia.map((n) => el("a", {
    href: n.url, target: "_blank", rel: "noopener", textContent: `Neuronpedia (${n.sae_release} L${n.sae_layer})`,
  })));
  $("frequency").replaceChildren(`fires on ${data.tokens_fired} of ${data.tokens} stored tokens ` +
    `(${(100 * data.frequency).toFixed(3)}%) · max ${fmt(data.max_activation)} · mean ${fmt(data.mean_activation)}`,
    ...(data.dense ? [" ", denseBadge(), ` fires on at least ${100 * data.dense_frequency}% of stored tokens: ` +
      "it says little about any one text"] : []));
  document.body.dataset.dense = String(Boolean(data.dense));
  const peak = Math.max(1, ...data.histogram.map((b) => b.count));
  $("histogram").replaceChildren(...data.histogram.map((b) => el("div", {
    className: "bar", title: `${fmt(b.low)} – ${fmt(b.high)}: ${b.count}`,
    dataset: { count: String(b.count) }, style: `height: ${(100 * b.count) / peak}%`,
  })));
  $("histogram-low").textContent = data.histogram.length ? fmt(data.histogram[0].low) : "";
  $("histogram-high").textContent = data.histogram.length ? fmt(data.histogram.at(-1).high) : "";
  const body = $("contexts").tBodies[0];
  body.replaceChildren(...data.contexts.map((c) => {
    const context = el("div", { className: "ctx" }, [
      ...c.before.map(tokenText),
      el("span", { className: "hl", textContent: tokenText(c.token), title: `position ${c.position}` }),
      ...c.after.map(tokenText),
    ]);
    const row = el("tr", { onclick: () => showRequest(c.request_id, data.feature_id) }, [
      el("td", { className: "act", textContent: fmt(c.activation) }),
      el("td", {}, [context]),
      el("td", { className: "rid", textContent: c.request_id }),
    ]);
    return row;
  }));
}

async function showRequest(requestId, feature) {
  const colour = feature ?? ($("colour-feature").value === "" ? null : Number($("colour-feature").value));
  if (colour !== null) $("colour-feature").value = colour;
  setStatus(`loading request ${requestId}…`);
  try {
    const query = colour === null ? "" : `?feature=${colour}`;
    const data = await api(`/api/v1/requests/${encodeURIComponent(requestId)}${query}`);
    state.request = requestId;
    drawRequest(data);
    setStatus(`request ${requestId}`);
    document.body.dataset.request = requestId;
    syncUrl();
  } catch (err) {
    setStatus(`error: ${err.message}`);
    document.body.dataset.error = err.message;
  }
}

function drawRequest(data) {
  $("request").hidden = false;
  $("request-title").textContent = data.request_id;
  $("request-meta").textContent = `${data.model_id || "unknown model"} · ${data.tokens.length} tokens with features ` +
    `· finish ${data.finish_reason || "–"}${data.truncated ? " · (first tokens only)" : ""}`;
  const peak = Math.max(1e-9, ...data.tokens.map((t) => t.feature_activation || 0));
  const rows = [];
  const spans = data.tokens.map((t, i) => {
    const span = el("span", {
      className: `tok${t.position < data.prompt_tokens ? " prompt" : " gen"}`, textContent: tokenText(t),
      title: `position ${t.position}${data.feature === null ? "" : ` · feature ${data.feature}: ${fmt(t.feature_activation)}`}`,
      dataset: { position: String(t.position), activation: String(t.feature_activation ?? "") },
      onclick: () => selectToken(i),
    });
    if (data.feature !== null && t.feature_activation > 0) {
      span.style.background = `rgba(255, 140, 0, ${(0.15 + 0.85 * t.feature_activation / peak).toFixed(3)})`;
    }
    rows.push(el("tr", {}, [
      el("td", { textContent: String(t.position) }),
      el("td", { className: "ctx", textContent: JSON.stringify(tokenText(t)) }),
      el("td", {}, t.features.map((f) => el("span", {}, [featureLink(f.feature_id, f.dense),
                                                          `(${fmt(f.activation)}) `]))),
    ]));
    return span;
  });
  $("request-tokens").replaceChildren(...spans);
  $("token-features").tBodies[0].replaceChildren(...rows);
  $("request-features").tBodies[0].replaceChildren(...data.features.map((f) => el("tr", {}, [
    el("td", {}, [featureLink(f.feature_id, f.dense), ...(f.dense ? [denseBadge()] : [])]),
    el("td", { className: "act", textContent: fmt(f.max_activation) }),
    el("td", { className: "act", textContent: String(f.tokens) }),
    el("td", { className: "act", textContent: `${(100 * f.store_frequency).toFixed(1)}%` }),
    el("td", { className: "act", textContent: fmt(f.specificity) }),
  ])));

  function selectToken(i) {
    spans.forEach((s, j) => s.classList.toggle("selected", i === j));
    rows.forEach((r, j) => r.classList.toggle("selected", i === j));
    rows[i].scrollIntoView({ block: "nearest" });
  }
}

async function loadRequests() {
  try {
    const data = await api("/api/v1/requests?limit=50");
    $("requests").replaceChildren(...data.requests.map((r) => el("li", {
      onclick: () => showRequest(r.request_id, state.feature), dataset: { requestId: r.request_id },
    }, [
      el("div", { className: "rid", textContent: r.request_id }),
      el("div", { textContent: `${(r.prompt_preview || "").slice(0, 80)} → ${(r.output_preview || "").slice(0, 60)}` }),
    ])));
    if (!data.requests.length) $("requests").replaceChildren(el("li", { textContent: "no requests stored yet" }));
  } catch (err) {
    setStatus(`error: ${err.message}`);
    document.body.dataset.error = err.message;
  }
}

$("search").addEventListener("submit", (event) => { event.preventDefault(); showFeature($("feature-id").value); });
$("recolour").addEventListener("click", () => state.request !== null && showRequest(state.request, null));
if (apiKey) $("viewer-link").href = withKey("./");

async function linkViewer() {
  // the viewer page exists where a model is served; a store-only browser has none
  try {
    const health = await api("/healthz");
    $("viewer-link").hidden = !health.model;
  } catch (err) { /* no viewer link */ }
}

(async () => {
  await Promise.all([loadRequests(), linkViewer()]);
  if (params.has("feature")) await showFeature(params.get("feature"));
  if (params.has("request")) await showRequest(params.get("request"), state.feature);
  document.body.dataset.ready = "true";
})();
