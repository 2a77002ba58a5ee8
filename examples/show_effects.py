"""Before and after: each example mod beside the same request without it (greedy, SAE inline).

Run: python examples/show_effects.py — prints the feature ids, where they fired, and both texts.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from engine import Engine
from mods import ForwardPass

HERE = Path(__file__).resolve().parent
CASES = [
    ("stay_on_topic", "Give me a tip for cooking pasta before the football match."),
    ("steer_feature", "Tell me about your weekend."),
]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main() -> int:
    overrides = {"activations": {"enabled": True, "db_path": "artifacts/example-effects.duckdb"},
                 "sae": {"enabled": True, "mode": "inline"}}
    with Engine.from_config(overrides=overrides) as engine:
        for name, prompt in CASES:
            module = _module(name)
            feature = getattr(module, "OFF_TOPIC_FEATURE", None) or getattr(module, "FEATURE")
            plain = engine.generate(prompt, max_tokens=48, temperature=0.0)
            fired = [e.step for e in plain.events if isinstance(e, ForwardPass)
                     and e.sae_features.value_of(feature) > getattr(module, "THRESHOLD", 0.0)]
            modded = engine.generate(prompt, max_tokens=48, temperature=0.0, mods=[getattr(module, name)])
            print(f"== {name}: feature {feature}; in the plain run it fires at steps {fired[:10]}")
            print(f"prompt: {prompt}")
            print(f"without: {plain.output_text!r}")
            print(f"with:    {modded.output_text!r}  ({len(modded.actions)} actions applied)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
