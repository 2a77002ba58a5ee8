"""The Ray side of raylens: the ``raylens`` command line, Ray Jobs, the HTTP server, and the tools
around the engine (benchmarks, SAE training).

``engine/`` runs the model in one process and knows nothing of Ray; ``actors/`` wraps it in Ray
actors. This package wires those actors on a cluster and gives users their entry points. By role:

``cluster/``       the raylens actors on a Ray cluster: which ones a config runs, their names and
                   resources, joining the cluster, get-or-create (``topology``).
``jobs/``          Ray Jobs entry points: ``python -m pipelines.jobs.generate`` (prompts file in,
                   results out) and ``python -m pipelines.jobs.embed``, and the prompts-file reader.
``serve/``         ``raylens serve``: the OpenAI-compatible and attention-streaming HTTP APIs.
``bench/``         the measurements behind ``raylens bench``, one module per bench mode, and what
                   they share (``measure``).
``sae_training/``  training the embedded model's SAE (``python -m pipelines.sae_training.train``)
                   and the corpus it is trained on.
``cli/``           the ``raylens`` command: argument parsing and dispatch, one module per command
                   group.

What may import what (tests/unit/test_pipelines_imports.py checks it, and that the import graph
has no cycle):

- ``cluster`` and ``sae_training`` import nothing else of ``pipelines``;
- ``jobs`` and ``serve`` import ``cluster``;
- ``bench`` imports ``cluster``, ``jobs`` and ``serve`` (its Ray and HTTP modes run them);
- ``cli`` may import every other subpackage, and nothing imports ``cli``.

Every module here may import ``engine``, ``actors`` and ``mods``; none of those imports
``pipelines``.
"""
