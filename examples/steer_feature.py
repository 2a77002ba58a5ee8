"""A steering mod: add an SAE feature's decoder direction to the residual stream at the SAE's layer
on every forward of the request, so the text leans toward what the feature stands for.

Needs the engine's SAE loaded (``sae.enabled: true``; inline mode also puts the features on the
events). Run:

    raylens generate --prompt "Tell me about your weekend." --mod examples/steer_feature.py:steer_feature \\
        --temperature 0 --max-tokens 48 --sae-inline
"""

from mods.features import steer_toward

FEATURE = 1145  # the strongest cooking feature (examples/feature_finder.py, the committed SAE)
SCALE = 20.0

steer_feature = steer_toward(FEATURE, SCALE, name="steer_feature")
