"""``keep_logits``: a config default and a per-request switch, checked like every other field;
the GeneratorActor's engine turns it off (its results leave without their events)."""

import dataclasses
import pickle

import pytest

from engine.config import GenerationConfig
from engine.core.inputs import GenerationRequest
from engine.errors import ConfigError, InvalidRequestError, LogitsNotKeptError
from engine.model.tensor import ReleasedLogits


def test_the_default_releases_them_and_a_non_boolean_is_refused_naming_the_field():
    assert GenerationConfig().keep_logits is False
    with pytest.raises(ConfigError, match="`keep_logits` must be true or false, got 'no'"):
        GenerationConfig(keep_logits="no")
    with pytest.raises(InvalidRequestError, match="keep_logits") as info:
        GenerationRequest(prompt="hi", keep_logits=1)
    assert info.value.parameter == "keep_logits"
    assert GenerationRequest(prompt="hi", keep_logits=False).keep_logits is False


def test_the_generator_actors_engine_does_not_keep_them():
    from actors.generator import local_engine_config
    from engine.config import load_config
    from tests.helpers import REPO

    config = load_config(REPO / "configs" / "local.yaml", env={})
    assert config.generation.keep_logits is False
    asked = dataclasses.replace(config, generation=dataclasses.replace(config.generation, keep_logits=True))
    assert local_engine_config(asked).generation.keep_logits is False  # even when a config asks for them


def test_released_logits_keep_their_shape_and_refuse_every_read():
    released = pickle.loads(pickle.dumps(ReleasedLogits((1, 7), 3)))
    assert released.shape == (1, 7) and len(released) == 1
    for read in (lambda r: r.to_numpy(), lambda r: r.numpy(), lambda r: r.tensor, lambda r: r[0, 0],
                 lambda r: r.to("cpu"), lambda r: r.device, lambda r: float(r)):
        with pytest.raises(LogitsNotKeptError, match="step 3") as info:
            read(released)
        assert info.value.parameter == "keep_logits"
