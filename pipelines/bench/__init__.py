"""The measurements behind ``raylens bench``: each module runs one bench mode and formats its
table; the command (:mod:`pipelines.cli.bench_command`) picks the mode and writes the report.

``measure``           what every mode shares: the prompt, a logits-adjusting mod, the machine.
``generation_paths``  raylens' generation paths beside bare ``model.generate`` (the default).
``strategy_masks``    a constrained-generation step beside a forward pass (every default run).
``sae_nearline``      SAE encode, store append, generation with nearline SAE (``--sae``).
``ray_pipeline``      the Ray actors end to end beside the in-process engine (``--ray``).
``batching``          N concurrent requests beside transformers' padded batch (``--concurrency``).
``decode_modes``      ``backend.graph_decode`` off / static / compile (``--decode-modes``).
``internals``         embeddings and named-tensor capture (``--internals``).
``serving``           the WebSocket server beside in-process requests (``--serve``).
``long_prompt``       a long prompt arriving beside streaming requests (not wired into the command yet).

Imports :mod:`pipelines.cluster`, :mod:`pipelines.jobs` and :mod:`pipelines.serve` (the modes
that run them), never :mod:`pipelines.cli`.
"""
