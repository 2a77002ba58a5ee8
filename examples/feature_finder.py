"""Which SAE features tell two kinds of text apart? Run: python examples/feature_finder.py

Encodes a few texts of each kind with the configured SAE (the embedded model's by default) and
prints the features whose mean activation differs most between them: candidates for the
feature-gated example mods in this folder (``stay_on_topic.py``, ``steer_feature.py``).
"""

from __future__ import annotations

import sys

import torch

from engine import Engine
from engine.model.capture import CapturePlan

KINDS = {
    "cooking": ["Chop the onions finely and fry them in butter until golden.",
                "Add a pinch of salt to the boiling water before the pasta goes in.",
                "Knead the dough for ten minutes, then let it rise in a warm place."],
    "football": ["The striker scored twice in the second half and the crowd went wild.",
                 "The referee showed a red card after the tackle in the penalty box.",
                 "The goalkeeper saved the penalty and the team won the league."],
}


def mean_features(engine: Engine, texts: list[str]) -> torch.Tensor:
    encoder = engine.recorder.encoder
    layer = encoder.identity.layer
    total = torch.zeros(encoder.identity.d_sae)
    count = 0
    for i, text in enumerate(texts):
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        out = engine.loop.forward_prompt(ids, CapturePlan.of([f"blocks.{layer}.hook_resid_post"],
                                                            engine.backend.info.num_layers, all_query_rows=True))
        values, indices = encoder.encode_topk(out.captured.hidden[layer][1:])
        dense = torch.zeros(values.shape[0], encoder.identity.d_sae).scatter_(1, indices.cpu(), values.float().cpu())
        total += dense.sum(0)
        count += dense.shape[0]
    return total / count


def main() -> int:
    overrides = {"activations": {"enabled": True, "db_path": "artifacts/feature-finder.duckdb"},
                 "sae": {"enabled": True, "mode": "inline"}}
    with Engine.from_config(overrides=overrides) as engine:
        means = {kind: mean_features(engine, texts) for kind, texts in KINDS.items()}
    (a, ma), (b, mb) = means.items()
    for name, diff in ((a, ma - mb), (b, mb - ma)):
        top = torch.topk(diff, 5)
        print(f"features of {name}: " + ", ".join(f"{int(i)} (+{float(v):.2f})" for v, i in zip(*top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
