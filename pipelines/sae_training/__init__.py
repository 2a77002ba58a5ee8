"""Training the embedded model's SAE (``python -m pipelines.sae_training.train``, also ``raylens
train-sae``) on a broad, licensed, offline corpus.

``train``            collect residual-stream activations, train with sae-lens, evaluate on the
                     held-out sequences, save the SAE and its report.
``corpus``           the corpus: its sources, their mix, and the seeded token sequences.
``corpus_readers``   each source's files as text passages.
``debian_packages``  fetching and unpacking the Debian packages the sources ship in.
``heldout_evals``    sae-lens' figures on text from outside the corpus (``train`` calls it).

Imports nothing else of ``pipelines``; only the CLI imports it.
"""

from pathlib import Path

#: Where the committed SAE lives (the engine's registry reads it from there): the default output
#: of a training run and the default SAE the outside-corpus evals update. Here, not in ``train``,
#: because ``train`` imports ``heldout_evals``.
COMMITTED_SAE_DIR = Path(__file__).resolve().parents[2] / "engine" / "assets" / "saes" / "smollm2-135m-instruct-l16"
