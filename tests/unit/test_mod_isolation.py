"""Mod payloads share the process without touching it: each payload's modules live in a private
namespace (no module of the process replaced, nothing on ``sys.path``, no collisions between
payloads), and directory payloads load only from the directories the operator allowed."""

from __future__ import annotations

import gc
import json
import os
import sys
import textwrap

import pytest

import mods
import mods.types
from mods.loading import ModDirNotAllowedError, ModPayloadError, load_mod_from_path, load_mod_from_payload, resolve_mods
from mods.payload_namespace import PAYLOAD_PREFIX, PayloadNamespace
from mods.types import ForceTokens, Sampled

EVENT = Sampled("iso", 0, 1)

# A mod that reports, as forced token ids, what it sees under an import name.
REPORTS_JSON = textwrap.dedent('''
    import json
    from quote_mod_sdk import mod

    @mod
    def report(event, actions, tokenizer):
        return actions.force_tokens([json.MARK if hasattr(json, "MARK") else len(json.dumps([1]))])
''')


def _inline(source: str, module: str, entry: str = "report") -> dict:
    return {"language": "python", "entrypoint": entry, "source": source, "module": module}


def _bundle(sources: dict[str, str], module: str, entry: str = "report") -> dict:
    return {"language": "python", "entrypoint": entry, "source": sources, "module": module}


def _process_modules() -> dict[str, object]:
    return {name: module for name, module in sys.modules.items() if not name.startswith(PAYLOAD_PREFIX)}


def _payload_modules() -> set[str]:
    return {name for name in sys.modules if name.startswith(PAYLOAD_PREFIX)}


def test_an_inline_module_named_json_does_not_replace_json():
    real = sys.modules["json"]
    hijack = "MARK = 7\ndef dumps(*args, **kwargs):\n    return 'hijacked'\n" + REPORTS_JSON
    loaded = load_mod_from_payload(_inline(hijack, module="json"))
    assert loaded(EVENT).tokens == [7], "positive control: inside its namespace, `json` is the payload's module"
    assert sys.modules["json"] is real and json.dumps({}) == "{}"
    later = load_mod_from_payload(_inline(REPORTS_JSON, module="after_json"))
    assert later(EVENT).tokens == [3], "a later payload sees the real json (3 = len('[1]'))"


def test_a_bundle_that_ships_json_sees_its_own_but_the_process_and_later_payloads_see_the_real_one():
    bundle = _bundle({"pkg/json.py": "MARK = 9\n", "pkg/mod.py": REPORTS_JSON}, module="pkg.mod")
    shadow = _bundle({"json.py": "MARK = 9\n", "pkg/mod.py": REPORTS_JSON}, module="pkg.mod")
    real = sys.modules["json"]
    assert load_mod_from_payload(bundle)(EVENT).tokens == [3], "pkg/json.py is pkg.json, not json"
    assert load_mod_from_payload(shadow)(EVENT).tokens == [9], "positive control: a top-level json.py is the payload's"
    assert sys.modules["json"] is real and json.dumps([1]) == "[1]"
    later = load_mod_from_payload(_inline(REPORTS_JSON, module="later_json_user"))
    assert later(EVENT).tokens == [3]


def test_a_bundle_that_ships_a_mods_package_leaves_the_sdk_in_place():
    sdk_before = {name: sys.modules[name] for name in ("mods", "mods.types", "quote_mod_sdk", "shared.types")}
    hostile = _bundle({
        "mods/__init__.py": "raise RuntimeError('a fake SDK must never be imported')\n",
        "mods/types.py": "class ForceTokens: pass\n",
        "quote_mod_sdk/__init__.py": "raise RuntimeError('nor a fake legacy SDK')\n",
        "examples/m/mod.py": textwrap.dedent('''
            from mods.types import ForceTokens
            from quote_mod_sdk import mod

            @mod
            def report(event, actions, tokenizer):
                return ForceTokens([5])
        '''),
    }, module="examples.m.mod")
    loaded = load_mod_from_payload(hostile)
    action = loaded(EVENT)
    assert isinstance(action, mods.types.ForceTokens) and action.tokens == [5], "its `mods` is the SDK itself"
    assert {name: sys.modules[name] for name in sdk_before} == sdk_before
    later = load_mod_from_payload(_inline(REPORTS_JSON, module="after_the_fake_sdk"))
    assert isinstance(later(EVENT), ForceTokens)


def test_a_payload_importing_its_own_module_under_an_sdk_name_gets_a_clear_error():
    payload = _bundle({"mods/helpers.py": "X = 1\n", "m.py": "from mods.helpers import X\ndef report(e, t=None):\n    pass\n"},
                      module="m")
    with pytest.raises(ModPayloadError, match="`mods` always names the mod SDK.*rename that folder"):
        load_mod_from_payload(payload)


def test_two_payloads_with_the_same_module_names_keep_their_own_code():
    def bundle(value: int) -> dict:
        return _bundle({
            "lib/util.py": f"VALUE = {value}\n",
            "lib/mod.py": textwrap.dedent('''
                from quote_mod_sdk import mod

                @mod
                def report(event, actions, tokenizer):
                    from lib.util import VALUE  # resolved at call time, inside this payload
                    return actions.force_tokens([VALUE])
            '''),
        }, module="lib.mod")

    first, second = load_mod_from_payload(bundle(1)), load_mod_from_payload(bundle(2))
    assert first(EVENT).tokens == [1] and second(EVENT).tokens == [2]
    same = "VALUE = {v}\ndef report(event, tokenizer=None):\n    from quote_mod_sdk import ForceTokens\n" \
           "    return ForceTokens([VALUE])\n"
    inline = [load_mod_from_payload(_inline(same.format(v=v), module="same_name")) for v in (4, 6)]
    assert [m(EVENT).tokens for m in inline] == [[4], [6]]
    assert "same_name" not in sys.modules


def test_loading_every_form_leaves_sys_path_and_the_process_modules_unchanged(tmp_path):
    (tmp_path / "pkgdir").mkdir()
    (tmp_path / "pkgdir" / "mod.py").write_text(REPORTS_JSON)
    (tmp_path / "plain.py").write_text(REPORTS_JSON)
    load_mod_from_payload(_inline(REPORTS_JSON, module="warmup"))  # installs the legacy names first
    path_before, modules_before = list(sys.path), _process_modules()
    kept = [
        load_mod_from_payload(_inline(REPORTS_JSON, module="client_mod")),
        load_mod_from_payload(_bundle({"pkgdir/mod.py": REPORTS_JSON}, module="pkgdir.mod")),
        load_mod_from_payload({"language": "python", "entrypoint": "report", "module": "pkgdir.mod",
                               "dir": str(tmp_path / "pkgdir")}, allowed_dirs=[tmp_path]),
        load_mod_from_path(tmp_path / "plain.py"),
    ]
    assert [m(EVENT).tokens for m in kept] == [[3]] * 4
    assert sys.path == path_before
    after = _process_modules()
    assert {n: m for n, m in after.items() if n in modules_before} == modules_before
    assert not {"client_mod", "pkgdir", "pkgdir.mod", "plain"} & set(after)


def test_a_payload_namespace_is_unloaded_when_its_mod_is_dropped():
    before = _payload_modules()
    loaded = load_mod_from_payload(_bundle({"a/b.py": REPORTS_JSON}, module="a.b"))
    added = _payload_modules() - before
    assert any(name.endswith(".a.b") for name in added)
    prefix = next(iter(added)).split(".")[0]
    del loaded
    gc.collect()
    assert not _payload_modules() & added
    assert not [f for f in sys.meta_path if isinstance(f, PayloadNamespace) and f.prefix == prefix]


def test_reloading_a_mod_file_replaces_its_namespace_instead_of_adding_one(tmp_path):
    path = tmp_path / "again.py"
    path.write_text(REPORTS_JSON)
    load_mod_from_path(path)
    count = len(_payload_modules())
    finders = sum(isinstance(f, PayloadNamespace) for f in sys.meta_path)
    for _ in range(3):
        load_mod_from_path(path)
    assert len(_payload_modules()) == count and sum(isinstance(f, PayloadNamespace) for f in sys.meta_path) == finders


def test_a_payload_calling_sys_exit_while_loading_fails_its_load_only():
    with pytest.raises(ModPayloadError, match="SystemExit"):
        load_mod_from_payload(_inline("import sys\nsys.exit(3)\n", module="exits"))


# ---------------------------------------------------------------------------- allowed directories


def _dir_payload(directory, module: str = "pkg.mod") -> dict:
    return {"language": "python", "entrypoint": "report", "module": module, "dir": str(directory)}


@pytest.fixture
def dirs(tmp_path):
    """``allowed/pkg/mod.py`` (loadable) and ``outside/pkg/mod.py`` (never loadable)."""
    for top in ("allowed", "outside"):
        (tmp_path / top / "pkg").mkdir(parents=True)
        (tmp_path / top / "pkg" / "mod.py").write_text(REPORTS_JSON)
    return tmp_path


def test_a_directory_payload_loads_from_an_allowed_directory(dirs):
    loaded = load_mod_from_payload(_dir_payload(dirs / "allowed" / "pkg"), allowed_dirs=[dirs / "allowed"])
    assert loaded(EVENT).tokens == [3]
    (via_resolve,) = resolve_mods([_dir_payload(dirs / "allowed" / "pkg")], allowed_dirs=iter([dirs / "allowed"]))
    assert via_resolve(EVENT).tokens == [3]


def test_directory_payloads_are_refused_when_no_directory_is_allowed(dirs):
    with pytest.raises(ModDirNotAllowedError, match=r"`generation.mod_dirs` must list the directories") as info:
        load_mod_from_payload(_dir_payload(dirs / "allowed" / "pkg"))
    assert info.value.parameter == "dir" and isinstance(info.value, ModPayloadError)
    with pytest.raises(ModDirNotAllowedError):
        resolve_mods([_dir_payload(dirs / "allowed" / "pkg")])


@pytest.mark.parametrize("named", [
    "outside/pkg",
    "allowed/../outside/pkg",
    "allowed/escape",  # a symlink to outside/pkg
])
def test_a_directory_payload_naming_a_path_outside_the_allowed_dirs_is_refused(dirs, named):
    os.symlink(dirs / "outside" / "pkg", dirs / "allowed" / "escape")
    with pytest.raises(ModDirNotAllowedError, match=r"`dir` must be inside a directory listed in `generation.mod_dirs`"):
        load_mod_from_payload(_dir_payload(dirs / named), allowed_dirs=[dirs / "allowed"])
    files = {"language": "python", "entrypoint": "report", "module": "pkg.mod", "files": [str(dirs / named / "mod.py")]}
    with pytest.raises(ModDirNotAllowedError, match=r"`files\[0\]` must be inside"):
        load_mod_from_payload(files, allowed_dirs=[dirs / "allowed"])


def test_a_symlinked_module_file_leading_outside_is_refused(dirs):
    (dirs / "allowed" / "other").mkdir()
    os.symlink(dirs / "outside" / "pkg" / "mod.py", dirs / "allowed" / "other" / "mod.py")
    with pytest.raises(ModPayloadError, match="outside the allowed directory"):
        load_mod_from_payload(_dir_payload(dirs / "allowed" / "other", module="other.mod"),
                              allowed_dirs=[dirs / "allowed"])


def test_the_module_search_stops_at_the_allowed_directory(dirs):
    """The module lies above the allowed directory: it is not found, though it exists."""
    with pytest.raises(ModPayloadError, match=r"was not found as pkg/mod.py"):
        load_mod_from_payload(_dir_payload(dirs / "outside" / "pkg"), allowed_dirs=[dirs / "outside" / "pkg"])
