"""Training the embedded model's SAE (``python -m pipelines.sae_training.train``, also ``raylens
train-sae``) on a broad, licensed, offline corpus.

``train``            collect residual-stream activations, train with sae-lens, evaluate on the
                     held-out sequences, save the SAE and its report.
``corpus``           the corpus: its sources, their mix, and the seeded token sequences.
``corpus_readers``   each source's files as text passages.
``debian_packages``  fetching and unpacking the Debian packages the sources ship in.

Imports nothing else of ``pipelines``; only the CLI imports it.
"""
