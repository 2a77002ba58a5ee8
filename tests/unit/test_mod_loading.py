"""Loading mods from files and payloads; the legacy import names."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from pathlib import Path

import pytest

from mods.legacy_names import install_legacy_names
from mods.loading import ModLoadError, ModPayloadError, load_mod_from_path, load_mod_from_payload, resolve_mods
from mods.serialization import serialize_mod
from mods.types import Added, ForceTokens, ForwardPass, Noop, Sampled

LEGACY_MOD = textwrap.dedent('''
    from quote_mod_sdk import mod, Sampled
    from shared.types import ForceTokens
    from shared.utils import validate_action
    from max.driver import Tensor

    @mod
    def legacy(event, actions, tokenizer):
        if isinstance(event, Sampled):
            return actions.force_tokens([42])
''')


def test_legacy_names_resolve_to_the_same_module_objects():
    install_legacy_names()
    import mods
    import mods.actions
    import mods.types
    import mods.validation

    assert importlib.import_module("quote_mod_sdk") is mods
    assert importlib.import_module("sdk.quote_mod_sdk.actions") is importlib.import_module("quote_mod_sdk.actions")
    assert importlib.import_module("quote_mod_sdk.actions") is mods.actions
    assert importlib.import_module("shared.types") is mods.types
    assert importlib.import_module("shared.utils") is mods.validation
    assert importlib.import_module("quote.mods.manager").ModManager is importlib.import_module("mods.manager").ModManager
    from quote_mod_sdk import mod as legacy_mod  # the decorator, not a module

    assert callable(legacy_mod) and legacy_mod is mods.mod


def test_max_driver_tensor_is_the_bound_class():
    class Marker:
        pass

    from mods.tensor import NumpyTensor

    try:
        install_legacy_names(tensor_class=Marker)
        from max.driver import Tensor

        assert Tensor is Marker
    finally:
        install_legacy_names(tensor_class=NumpyTensor)


def test_a_legacy_mod_file_loads_unchanged(tmp_path):
    path = tmp_path / "legacy_mod.py"
    path.write_text(LEGACY_MOD)
    loaded = load_mod_from_path(path)
    assert loaded.__name__ == "legacy"
    assert isinstance(loaded(Sampled("r", 0, 1)), ForceTokens)


def test_two_files_with_the_same_name_do_not_collide(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d, value in (("a", 1), ("b", 2)):
        (tmp_path / d / "m.py").write_text(LEGACY_MOD.replace("[42]", f"[{value}]"))
    first = load_mod_from_path(tmp_path / "a" / "m.py")
    second = load_mod_from_path(tmp_path / "b" / "m.py")
    assert first(Sampled("r", 0, 1)).tokens == [1] and second(Sampled("r", 0, 1)).tokens == [2]


def test_entry_selection_and_errors(tmp_path):
    two = tmp_path / "two.py"
    two.write_text(LEGACY_MOD + LEGACY_MOD.replace("def legacy", "def other"))
    with pytest.raises(ModLoadError, match=r"several mods \(legacy, other\)"):
        load_mod_from_path(two)
    assert load_mod_from_path(f"{two}:other").__name__ == "other"
    with pytest.raises(ModLoadError, match="does not exist"):
        load_mod_from_path(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("def oops(:\n")
    with pytest.raises(ModLoadError, match="syntax error at line 1"):
        load_mod_from_path(broken)
    failing = tmp_path / "failing.py"
    failing.write_text("import no_such_module_xyz\n")
    with pytest.raises(ModLoadError, match="No module named 'no_such_module_xyz'"):
        load_mod_from_path(failing)
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ModLoadError, match="no @mod-decorated function"):
        load_mod_from_path(empty)


def test_inline_payload_loads_and_is_bridged():
    loaded = load_mod_from_payload({"language": "python", "entrypoint": "legacy", "source": LEGACY_MOD,
                                    "module": "inline_legacy_test"})
    assert loaded.__name__ == "legacy"
    assert isinstance(loaded(Sampled("r", 0, 1), None), ForceTokens)
    assert isinstance(loaded(Added("r", 0, [1], False)), Noop)


@pytest.mark.parametrize("payload,message", [
    ({"language": "rust", "entrypoint": "m", "source": "x"}, "Only Python mods"),
    ({"language": "python", "source": "x = 1"}, "`entrypoint` must be a non-empty string"),
    ({"language": "python", "entrypoint": "m"}, "needs `source`"),
    ({"language": "python", "entrypoint": "m", "source": "x = ("}, "failed while loading"),
    ({"language": "python", "entrypoint": "m", "source": "x = 1"}, "no callable named `m`"),
    ([1, 2], "must be a JSON object"),
])
def test_malformed_payloads_give_clear_errors(payload, message):
    with pytest.raises(ModPayloadError, match=message):
        load_mod_from_payload(payload)


def test_bridged_mod_errors_are_payload_errors_with_the_cause_chained():
    source = "def m(event, tokenizer=None):\n    raise KeyError('inner')\n"
    loaded = load_mod_from_payload({"language": "python", "entrypoint": "m", "source": source})
    with pytest.raises(ModPayloadError, match="Mod raised exception") as info:
        loaded(Sampled("r", 0, 1))
    assert isinstance(info.value.__cause__, KeyError)


def test_serialize_mod_round_trips_through_the_inline_payload(tmp_path):
    path = tmp_path / "roundtrip_mod.py"
    path.write_text(LEGACY_MOD)
    original = load_mod_from_path(path)
    payload = serialize_mod(original, name="rt")
    assert payload["entrypoint"] == "legacy" and payload["name"] == "rt" and "def legacy" in payload["source"]
    payload["module"] = "roundtrip_inline"
    again = load_mod_from_payload(payload)
    assert again(Sampled("r", 0, 1)).tokens == [42]
    assert "roundtrip_inline" not in sys.modules, "a payload module must live in its private namespace"
    assert any(name.endswith(".roundtrip_inline") for name in sys.modules)


def test_resolve_mods_accepts_callables_paths_and_payloads(tmp_path):
    path = tmp_path / "p.py"
    path.write_text(LEGACY_MOD)

    def raw(event, tokenizer=None):
        return Noop()

    payload = {"language": "python", "entrypoint": "legacy", "source": LEGACY_MOD}
    loaded = resolve_mods([raw, str(path), payload])
    assert [m.__name__ for m in loaded] == ["raw", "legacy", "legacy"]
    with pytest.raises(ModLoadError, match="must accept \\(event, tokenizer\\)"):
        resolve_mods([lambda: None])
    with pytest.raises(ModLoadError, match="must be a callable, a .py path or a payload dict"):
        resolve_mods([42])


# ------------------------------------------------------------------- package, bundle, directory

GREETER = Path(__file__).resolve().parent.parent / "sdk_mods" / "examples" / "greeter" / "mod.py"


def test_a_package_style_mod_file_loads_with_its_relative_and_absolute_imports():
    greeter = load_mod_from_path(GREETER)
    assert greeter.__name__ == "greeter"
    event = ForwardPass("pkg", 0, None)
    action = greeter(event, _tok())
    assert isinstance(action, ForceTokens) and action.tokens == _tok().encode(" Greetings from a package!")


def test_the_bundle_payload_form_round_trips():
    from mods.loading import bundle_payload

    payload = bundle_payload(GREETER, "greeter")
    assert payload["module"] == "examples.greeter.mod"
    assert set(payload["source"]) == {"examples/greeter/mod.py", "examples/greeter/phrases.py"}
    loaded = load_mod_from_payload(json.loads(json.dumps(payload)))  # survives JSON, as over HTTP
    assert isinstance(loaded(ForwardPass("bundle", 0, None), _tok()), ForceTokens)


def test_the_directory_payload_form_finds_the_module_above_dir():
    payload = {"language": "python", "entrypoint": "greeter", "module": "examples.greeter.mod",
               "dir": str(GREETER.parent)}
    loaded = load_mod_from_payload(payload, allowed_dirs=[GREETER.parent.parent.parent])
    assert isinstance(loaded(ForwardPass("dir", 0, None), _tok()), ForceTokens)


@pytest.mark.parametrize("payload,message", [
    ({"language": "python", "entrypoint": "m", "source": {"a.py": 3}}, "must map relative paths"),
    ({"language": "python", "entrypoint": "m", "source": {"a.py": "x = 1"}}, "needs `module`"),
    ({"language": "python", "entrypoint": "m", "source": {"a.py": "x = 1"}, "module": "b"}, "has no module `b`"),
    ({"language": "python", "entrypoint": "m", "source": {"a.py": "import nope_nope"}, "module": "a"},
     "failed while loading"),
    ({"language": "python", "entrypoint": "m", "dir": "{tmp}/no/such/dir", "module": "a"}, "is not a directory"),
    ({"language": "python", "entrypoint": "m", "dir": "{tmp}", "module": "a"}, "was not found as a.py"),
    ({"language": "python", "entrypoint": "m", "dir": "{tmp}", "module": "a/../b"}, "dotted name of identifiers"),
])
def test_malformed_bundle_and_directory_payloads_are_clear(payload, message, tmp_path):
    if "dir" in payload:
        payload = {**payload, "dir": payload["dir"].replace("{tmp}", str(tmp_path))}
    with pytest.raises(ModPayloadError, match=message):
        load_mod_from_payload(payload, allowed_dirs=[tmp_path])


def _tok():
    from tests.helpers import CharTokenizer

    return CharTokenizer()


def test_payload_for_file_ships_plain_files_inline_and_package_files_as_bundles(tmp_path):
    from mods.loading import payload_for_file

    plain = tmp_path / "plain.py"
    plain.write_text(LEGACY_MOD)
    inline = payload_for_file(plain)
    assert isinstance(inline["source"], str) and inline["entrypoint"] == "legacy"
    assert isinstance(load_mod_from_payload(inline)(Sampled("r", 0, 1)), ForceTokens)
    bundle = payload_for_file(GREETER)
    assert isinstance(bundle["source"], dict) and bundle["module"] == "examples.greeter.mod"
