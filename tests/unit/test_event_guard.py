"""mods.event_guard: the engine leaves out a mod call only when the handler's own leading guard
sends the event straight to ``return None``.

Two kinds of test. The shapes mods are written in are each checked for what they turn away and
what they do not. And a property every answer must have: for every mod here and every event kind,
when ``turns_away`` says the call would do nothing, making the call for real returns a Noop and
leaves no trace (each mod writes down everything it does, in ``LOG``)."""

from __future__ import annotations

import abc
import functools
import types

import numpy as np
import pytest

import mods.types as T
from mods import mod
from mods.decorator import create_mod
from mods.event_guard import forget_decisions, turns_away, turns_away_all, turns_away_kind
from mods.manager import ModManager
from mods.types import Added, ForwardPass, Noop, Prefilled, Sampled
from mods.validation import validate_action

LOG: list[str] = []


def events() -> dict[str, object]:
    return {"Prefilled": Prefilled("r", 0, 8), "ForwardPass": ForwardPass("r", 1, np.zeros((1, 4), np.float32)),
            "Sampled": Sampled("r", 1, 3), "Added": Added("r", 1, [3], False)}


def turned_away(m) -> set[str]:
    return {name for name, event in events().items() if turns_away(m, event)}


# ---------------------------------------------------------------------------- the shapes mods take


@mod
def forward_only(event, actions, tokenizer):
    if isinstance(event, ForwardPass):
        LOG.append("forward_only")
        return actions.noop()
    return None


@mod
def chain(event, actions, tokenizer):
    """A docstring is no instruction."""
    if isinstance(event, ForwardPass):
        LOG.append("chain forward")
    elif isinstance(event, Added):
        LOG.append("chain added")


@mod
def early_return(event, actions):
    if not isinstance(event, (Sampled, Added)):
        return None
    LOG.append("early_return")


@mod
def either(event, actions, tokenizer):
    if isinstance(event, Sampled) or isinstance(event, Prefilled):
        LOG.append("either")


@mod
def both(event, actions, tokenizer):
    if isinstance(event, ForwardPass) and LOG.append("both") is None:
        LOG.append("both body")


@mod
def through_module(event, actions, tokenizer):
    if isinstance(event, T.Sampled):
        LOG.append("through_module")


@mod
def else_logs(event, actions, tokenizer):
    if isinstance(event, ForwardPass):
        return None
    else:
        LOG.append("else_logs")


@mod
def else_return(event, actions, tokenizer):
    if isinstance(event, Added):
        LOG.append("else_return")
    else:
        return None


def plain(event, tokenizer):  # no @mod: the manager calls it as plain(event, tokenizer)
    if isinstance(event, Prefilled):
        LOG.append("plain")


def closure_mod():
    from mods.types import ForwardPass as Forward

    @mod
    def nested(event, actions, tokenizer):
        if isinstance(event, Forward):
            LOG.append("nested")
        return None

    return nested


created = create_mod(lambda event, actions, tokenizer: None)


def created_guard(event, actions, tokenizer):
    if isinstance(event, Added):
        LOG.append("created_guard")


created_guarded = create_mod(created_guard)


@pytest.mark.parametrize("m, expected", [
    (forward_only, {"Prefilled", "Sampled", "Added"}),
    (chain, {"Prefilled", "Sampled"}),
    (early_return, {"Prefilled", "ForwardPass"}),
    (either, {"ForwardPass", "Added"}),
    (both, {"Prefilled", "Sampled", "Added"}),
    (through_module, {"Prefilled", "ForwardPass", "Added"}),
    (else_return, {"Prefilled", "ForwardPass", "Sampled"}),
    (else_logs, {"ForwardPass"}),
    (plain, {"ForwardPass", "Sampled", "Added"}),
    (closure_mod(), {"Prefilled", "Sampled", "Added"}),
    (created_guarded, {"Prefilled", "ForwardPass", "Sampled"}),
], ids=lambda v: getattr(v, "__name__", "") if callable(v) else "")
def test_a_guard_turns_away_exactly_the_events_it_sends_to_return_none(m, expected):
    assert turned_away(m) == expected


# ------------------------------------------------------------------------ calls that are always made


@mod
def logs_first(event, actions, tokenizer):
    LOG.append("logs_first")
    if isinstance(event, ForwardPass):
        return None


@mod
def generator_mod(event, actions, tokenizer):
    if isinstance(event, ForwardPass):
        yield None


@mod
def finally_logs(event, actions, tokenizer):
    try:
        if isinstance(event, ForwardPass):
            return actions.noop()
        return None
    finally:
        LOG.append("finally_logs")


class Meta(abc.ABC):  # a class whose metaclass runs its own instance check
    pass


@mod
def abc_guard(event, actions, tokenizer):
    if isinstance(event, Meta):
        LOG.append("abc_guard")


@mod
def unbound_guard(event, actions, tokenizer):
    if isinstance(event, NotDefinedAnywhere):  # noqa: F821 - the call raises NameError: it must be made
        LOG.append("unbound_guard")


@mod
def not_a_class(event, actions, tokenizer):
    if isinstance(event, LOG):
        LOG.append("not_a_class")


@mod
def other_test(event, actions, tokenizer):
    if type(event) is ForwardPass:
        LOG.append("other_test")


@mod
def missing_attribute(event, actions, tokenizer):
    if isinstance(event, T.NoSuchEvent):  # AttributeError in the call itself
        LOG.append("missing_attribute")


def one_argument(event):  # the manager's call (event, tokenizer) raises TypeError
    if isinstance(event, ForwardPass):
        LOG.append("one_argument")


def required_keyword(event, tokenizer, *, flag):
    if isinstance(event, ForwardPass):
        LOG.append("required_keyword")


class CallableMod:
    __name__ = "callable_mod"

    def __call__(self, event, tokenizer=None):
        if isinstance(event, ForwardPass):
            LOG.append("callable_mod")


def shadowed_isinstance():
    namespace = {"ForwardPass": ForwardPass, "LOG": LOG, "isinstance": lambda obj, cls: LOG.append("shadow") or True}
    exec("def shadowed(event, tokenizer):\n    if isinstance(event, ForwardPass):\n        LOG.append('x')\n", namespace)
    return namespace["shadowed"]


NEVER = [logs_first, generator_mod, finally_logs, abc_guard, unbound_guard, not_a_class, other_test,
         missing_attribute, one_argument, required_keyword, CallableMod(), functools.partial(plain),
         shadowed_isinstance(), created]


@pytest.mark.parametrize("m", NEVER, ids=lambda m: getattr(m, "__name__", type(m).__name__))
def test_a_call_the_guard_does_not_settle_is_always_made(m):
    assert turned_away(m) == set()


def rebinding_guard() -> tuple[dict, object]:
    """A mod whose guard reads the global ``Kind`` of a namespace the test rebinds (ForwardPass first)."""
    namespace = {"Kind": ForwardPass, "LOG": LOG}
    exec("def rebinds(event, tokenizer):\n    if isinstance(event, Kind):\n        LOG.append('rebinds')\n", namespace)
    return namespace, namespace["rebinds"]


def test_names_are_resolved_afresh_once_code_may_have_rebound_them():
    # forget_decisions is what a mod call, an event listener and each new step of the engine do
    namespace, m = rebinding_guard()
    assert turned_away(m) == {"Prefilled", "Sampled", "Added"}
    namespace["Kind"] = Sampled
    forget_decisions()
    assert turned_away(m) == {"Prefilled", "ForwardPass", "Added"}
    namespace["isinstance"] = lambda obj, cls: True  # now the guard's own isinstance is another function
    forget_decisions()
    assert turned_away(m) == set()


def test_a_decision_is_reused_until_code_runs_and_a_mod_call_is_code():
    namespace, m = rebinding_guard()
    assert turned_away(m) == {"Prefilled", "Sampled", "Added"}
    namespace["Kind"] = Sampled  # rebound by no code the engine ran: the decisions stand
    assert turned_away(m) == {"Prefilled", "Sampled", "Added"}

    def rebinding_mod(event, tokenizer):
        namespace["Kind"] = Added

    ModManager([rebinding_mod], call_timeout_s=None).dispatch_traced(Sampled("r", 1, 3))  # a mod call: decide afresh
    assert turned_away(m) == {"Prefilled", "ForwardPass", "Sampled"}
    # only the SDK's own event classes are decided once per class: any other object is read every time
    other = type("Other", (Added,), {})("r", 1, [3], False)
    namespace["Kind"] = ForwardPass
    forget_decisions()
    assert turns_away(m, other) is True
    namespace["Kind"] = type(other)
    assert turns_away(m, other) is False


def test_a_list_of_mods_is_decided_once_like_each_mod_and_afresh_when_a_mod_is_read_again():
    """turns_away_all: every request's manager has its own list, most often of the same mods; the
    answer for those mods is reused until code may have rebound a name, and a mod read afresh
    (its code replaced, then asked of another class) is not answered from before."""
    namespace, m = rebinding_guard()
    forget_decisions()
    lists = [[m, forward_only], [m, forward_only]]  # two requests', the same mods
    assert [turns_away_all(mods, Sampled) for mods in lists] == [True, True]
    assert turns_away_all([m, forward_only, logs_first], Sampled) is False  # logs_first hears every event
    namespace["Kind"] = Sampled  # rebound by no code the engine ran: the decision stands
    assert turns_away_all(lists[1], Sampled) is True
    forget_decisions()
    assert turns_away_all(lists[1], Sampled) is False
    assert turns_away_all(lists[0], Added) is True
    # several classes at once: turned away only when each of them is (a step's Sampled and Added)
    assert turns_away_all(lists[0], (Added, Prefilled)) is True
    assert turns_away_all(lists[0], (Added, Sampled)) is False
    assert turns_away_all(lists[0], (Sampled, Added)) is False

    def hears_all(event, tokenizer):
        LOG.append("hears_all")
    namespace["Kind"] = ForwardPass
    forget_decisions()
    assert turns_away_all([m], Added) is True
    m.__code__ = hears_all.__code__
    assert turns_away_kind(m, Prefilled) is False  # read again, for a class not decided yet
    assert turns_away_all([m], Added) is False, "a list's answer rests on each mod's reading"

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, event, tokenizer):
            return None

    class Hashes:
        def __hash__(self):
            LOG.append("hashed")
            return 1

        def __call__(self, event, tokenizer):
            return None
    LOG.clear()
    # not a plain function: called for every event, and none of its code runs to say so
    assert turns_away_all([Unhashable()], Added) is False
    assert turns_away_all([forward_only, Hashes()], Added) is False and LOG == []
    assert turns_away_all([], Added) is True


def test_a_function_whose_code_is_replaced_is_read_again():
    def guarded(event, tokenizer):
        if isinstance(event, ForwardPass):
            LOG.append("guarded")

    def unguarded(event, tokenizer):
        LOG.append("unguarded")

    assert turned_away(guarded) == {"Prefilled", "Sampled", "Added"}
    guarded.__code__ = unguarded.__code__
    forget_decisions()  # code ran (here the test's own)
    assert turned_away(guarded) == set()


# ------------------------------------------------------------------------- the property behind it


ALL = [forward_only, chain, early_return, either, both, through_module, else_return, else_logs, plain, closure_mod(),
       created_guarded, *NEVER]


@pytest.mark.parametrize("m", ALL, ids=lambda m: getattr(m, "__name__", type(m).__name__))
def test_every_call_turned_away_would_have_returned_a_noop_and_done_nothing(m):
    for name, event in events().items():
        if not turns_away(m, event):
            continue
        LOG.clear()
        result = validate_action(event, m(event, None))  # what the manager does with a call's return
        assert isinstance(result, Noop) and LOG == [], (name, LOG)


def test_the_property_test_can_fail():
    """A control for the test above: a call the guard lets through does leave a trace."""
    LOG.clear()
    forward_only(events()["ForwardPass"], None)
    assert LOG == ["forward_only"]


def test_a_handler_built_at_run_time_with_types_functiontype_is_read_like_any_other():
    code = forward_only.__wrapped__.__code__
    rebuilt = types.FunctionType(code, forward_only.__wrapped__.__globals__, "rebuilt")
    assert turned_away(mod(rebuilt)) == {"Prefilled", "Sampled", "Added"}


def test_an_sdk_wrapper_whose_handler_is_swapped_is_read_again():
    def guarded(event, actions, tokenizer):
        if isinstance(event, ForwardPass):
            LOG.append("guarded")

    def unguarded(event, actions, tokenizer):
        LOG.append("unguarded")

    wrapped = mod(guarded)
    assert turned_away(wrapped) == {"Prefilled", "Sampled", "Added"}
    cell = wrapped.__closure__[wrapped.__code__.co_freevars.index("handler")]
    cell.cell_contents = unguarded
    forget_decisions()
    assert turned_away(wrapped) == set()


def test_what_was_read_of_a_mod_goes_with_the_mod():
    import gc

    import mods.event_guard as guard

    def short_lived(event, tokenizer):
        if isinstance(event, ForwardPass):
            LOG.append("short_lived")

    assert turned_away(short_lived) == {"Prefilled", "Sampled", "Added"}
    key = id(short_lived)
    assert key in guard._READ and (key, Sampled) in guard._DECIDED
    del short_lived
    gc.collect()
    assert key not in guard._READ
    assert not any(decided[0] == key for decided in guard._DECIDED)
