"""A "stay on topic" mod: when a feature of the wrong topic fires on the newest token, erase that
token and ban it, so the model continues another way.

Needs the engine's SAE encoding inline (``sae.enabled: true``, ``sae.mode: inline``); find a
feature for your off-topic subject with ``examples/feature_finder.py``. Run:

    raylens generate --prompt "Give me a tip for cooking pasta before the football match." --mod examples/stay_on_topic.py:stay_on_topic \\
        --temperature 0 --max-tokens 48 --sae-inline
"""

from mods.features import backtrack_when

OFF_TOPIC_FEATURE = 6608  # fires on " game" (and nothing else in the plain answer) (examples/feature_finder.py, the committed SAE)
THRESHOLD = 9.0

stay_on_topic = backtrack_when(OFF_TOPIC_FEATURE, THRESHOLD, n=1, max_times=8, name="stay_on_topic")
