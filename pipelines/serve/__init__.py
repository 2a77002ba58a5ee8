"""``raylens serve``: the HTTP layer over the engine.

Two APIs on one FastAPI app (``app.build_app``): an OpenAI-compatible API with mods — chat,
completions, embeddings (``openai_api`` and its ``openai_*`` modules) — and an attention-streaming
API for attention-driven clients (``attention_api``), plus a viewer page (``static/``). ``deployment`` runs the app on Ray Serve; tests run it under
uvicorn over an in-process engine. Only ``deployment`` imports Ray.
"""
