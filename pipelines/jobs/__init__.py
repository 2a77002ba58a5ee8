"""Ray Jobs entry points, run as ``python -m pipelines.jobs.<name>`` on the cluster (``ray job
submit``, or ``raylens submit``, whose entrypoint is :func:`generate.job_entrypoint`).

``generate``      a prompts file through the GeneratorActor replicas, results JSONL out.
``prompts_file``  reading and checking a prompts file before anything runs (also ``raylens
                  submit``'s early check).
``embed``         one embedding per text through EmbedActors.

Imports :mod:`pipelines.cluster` (to connect and to get the actors) and nothing else of
``pipelines``; the CLI and the Ray bench import these modules.
"""
