"""The raylens actors on a Ray cluster, for every caller that needs them (jobs, the server, the
CLI's status and stop, the Ray bench).

``actor_specs``  which actors a config runs, their names (keyed by the config parts they hold),
                 roles and resource requests, and the capacity check; no Ray call.
``addresses``    what an address names (loopback or not), read without importing Ray.
``connection``   joining a running cluster, with the address probed first (and the address Ray
                 will really dial).
``topology``     get-or-create every actor of a config and wait until each answers.

Imports ``engine`` and ``actors`` only: nothing else of ``pipelines``, so every other subpackage
can build on it.
"""
