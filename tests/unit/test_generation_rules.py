"""Every event × action rule of engine/core/actions.py and engine/core/machine.py, exactly, on a scripted model.

The scripted model wants to write "hello world" then EOS; see tests/helpers.ScriptedBackend.
Each test compares with the mod-free output (positive control) and checks the event trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine.core.result import FinishReason
from engine.core.stream import Erased
from mods import (
    Added,
    AdjustedLogits,
    AdjustedPrefill,
    Backtrack,
    EmitError,
    ForceOutput,
    ForceTokens,
    ForwardPass,
    Noop,
    Prefilled,
    Sampled,
    ToolCalls,
    mod,
)
from tests.helpers import CharTokenizer, assert_payload_valid, event_types, scripted_engine

TOK = CharTokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text)


@dataclass
class Trace:
    """What a run did to the request's sequence: ``rewinds`` are the sizes of its erasures (from
    its token stream), ``forward_count`` the scripted model's forwards."""

    rewinds: list[int]
    forward_count: int


def run(mods=(), script="hello world", prompt="Q:", **kw):
    eng = scripted_engine(script, **kw)
    handle = eng.submit(input_ids=ids(prompt), mods=list(mods))
    rewinds = [e.n for e in handle if isinstance(e, Erased)]
    result = handle.result(timeout=30)
    assert_payload_valid(result.payload)
    eng.close()
    return result, Trace(rewinds, eng.backend.forward_count)


def on(event_cls, action_factory, *, step=None, once=True):
    """A raw mod: return ``action_factory(event)`` on ``event_cls`` (at ``step``), once by default."""
    fired = []

    def raw_mod(event, tokenizer=None):
        if type(event) is event_cls and (step is None or event.step == step) and not (once and fired):
            fired.append(event.step)
            return action_factory(event)
        return Noop()

    raw_mod.__name__ = f"on_{event_cls.__name__}_{step}"
    return raw_mod


def test_generation_without_mods_follows_the_script_and_stops_at_eos():
    result, _ = run()
    assert result.output_text == "hello world"
    assert result.finish_reason is FinishReason.STOP
    types = event_types(result)
    assert types[0] == "Prefilled" and types.count("Prefilled") == 1
    assert types[1:4] == ["ForwardPass", "Sampled", "Added"]
    steps = [e.step for e in result.events if isinstance(e, ForwardPass)]
    assert steps == list(range(len(steps)))  # 0, 1, 2, …
    assert TOK.eos_token_id not in result.output_ids  # the EOS was added (dispatched) but stripped


def test_max_tokens_ends_the_request_with_length():
    result, _ = run(max_tokens=4)
    assert result.output_text == "hell"
    assert result.finish_reason is FinishReason.LENGTH


def test_forward_pass_force_tokens_skip_sampling_and_arrive_as_one_forced_added():
    result, _ = run([on(ForwardPass, lambda e: ForceTokens(ids("XY")), step=0)])
    assert result.output_text.startswith("XY")
    step0 = [type(e).__name__ for e in result.events if e.step == 0]
    assert step0 == ["Prefilled", "ForwardPass", "Added"]  # no Sampled (DEV F5)
    added = next(e for e in result.events if isinstance(e, Added))
    assert added.added_tokens == ids("XY") and added.forced is True


def test_only_the_first_force_tokens_of_a_step_is_accepted():
    first = on(ForwardPass, lambda e: ForceTokens(ids("A")), step=1)
    second = on(ForwardPass, lambda e: ForceTokens(ids("B")), step=1)
    result, _ = run([first, second])
    assert result.output_text.startswith("hA")
    assert "B" not in result.output_text
    assert [type(i.action).__name__ for i in result.ignored_actions] == ["ForceTokens"]
    assert "one per step" in result.ignored_actions[0].reason


def test_sampled_force_tokens_replace_the_sampled_token():
    result, _ = run([on(Sampled, lambda e: ForceTokens(ids("Z")), step=0)])
    added = next(e for e in result.events if isinstance(e, Added))
    assert added.added_tokens == ids("Z") and added.forced
    assert result.output_ids[0] == ids("Z")[0]  # "h" was replaced, not followed (F6)


def test_added_force_tokens_are_committed_silently_after_the_added_tokens():
    result, _ = run([on(Added, lambda e: ForceTokens(ids("--")), step=0)])
    assert result.output_text.startswith("h--")
    forced_added = [e for e in result.events if isinstance(e, Added) and e.forced]
    assert forced_added == []  # no Added event announces the continuation


def test_forward_pass_backtrack_with_tokens_erases_committed_and_announces_reinjection():
    result, backend = run([on(ForwardPass, lambda e: Backtrack(2, ids("J")), step=3)])
    # "hel" committed at steps 0-2; erase "el", then reinject "J" as forced
    assert result.output_text.startswith("hJ")
    step3 = [type(e).__name__ for e in result.events if e.step == 3]
    assert step3 == ["ForwardPass", "Added"]
    assert backend.rewinds == [2]


def test_forward_pass_backtrack_without_tokens_ends_the_step_silently():
    for tokens in (None, []):  # None and [] behave alike
        result, _ = run([on(ForwardPass, lambda e, t=tokens: Backtrack(1, t), step=2)])
        step2 = [type(e).__name__ for e in result.events if e.step == 2]
        assert step2 == ["ForwardPass"]
        assert result.output_text.startswith("hel")  # "he" → "h", then the model writes "el…" again


def test_sampled_backtrack_counts_the_pending_sample_first():
    result, backend = run([on(Sampled, lambda e: Backtrack(1, ids("R")), step=2)])
    # n=1 erases only the pending sample "l": committed "he" stays
    assert result.output_text.startswith("heR")
    assert backend.rewinds == []  # nothing committed was erased
    result2, backend2 = run([on(Sampled, lambda e: Backtrack(2, ids("R")), step=2)])
    assert result2.output_text.startswith("hR") and backend2.rewinds == [1]


def test_added_backtrack_counts_the_just_added_tokens_first_and_reinjects_silently():
    result, backend = run([on(Added, lambda e: Backtrack(2, ids("Q")), step=2)])
    # "hel" committed at step 2; n=2 erases "l" (just added) and "e"; "Q" committed silently
    assert result.output_text.startswith("hQ")
    assert backend.rewinds == [2]
    assert not any(isinstance(e, Added) and e.forced for e in result.events)


def test_backtrack_never_erases_prompt_tokens():
    result, backend = run([on(ForwardPass, lambda e: Backtrack(50, None), step=1)])
    assert backend.rewinds == [1]  # only the one generated token
    note = result.payload["actions"][0]["details"]["note"]
    assert "prompt tokens are kept" in note
    assert result.prompt_ids == ids("Q:")


def test_backtrack_does_not_mutate_the_mods_action():
    action = Backtrack(3, ids("x"))
    run([on(Added, lambda e: action, step=4)])
    assert action.n == 3


@pytest.mark.parametrize("kind", ["numpy", "torch", "shim", "flat", "flat shim", "shim at temperature 0"])
def test_adjusted_logits_accepts_numpy_torch_and_shim_and_changes_the_sample(kind):
    # a shim of the row to_numpy lent (whole, or flattened) is applied as it is, without a copy
    def adjust(event):
        arr = event.logits.to_numpy()
        arr[0, ids("h")[0]] = -1e9  # ban the scripted first choice; the second ("e") wins
        shim = type(event.logits).from_numpy
        value = {"numpy": arr, "torch": torch.from_numpy(arr), "shim": shim(arr), "flat": arr[0],
                 "flat shim": shim(arr[0]), "shim at temperature 0": shim(arr)}[kind]
        return AdjustedLogits(value, token_temp=0.0 if kind.endswith("0") else None)

    baseline, _ = run()
    result, _ = run([on(ForwardPass, adjust, step=0)])
    assert baseline.output_text.startswith("h")
    assert result.output_ids[0] == ids("e")[0]


def test_adjusted_logits_last_one_wins():
    def ban(char):
        def adjust(event):
            arr = event.logits.to_numpy()
            arr[0, :] = -1e9
            arr[0, ids(char)[0]] = 0
            return AdjustedLogits(arr)
        return adjust

    result, _ = run([on(ForwardPass, ban("a"), step=0), on(ForwardPass, ban("b"), step=0)])
    assert result.output_ids[0] == ids("b")[0]


def test_adjusted_logits_with_wrong_width_end_the_request_with_a_reason():
    result, _ = run([on(ForwardPass, lambda e: AdjustedLogits(np.zeros((1, 7), np.float32)), step=1)])
    assert result.finish_reason is FinishReason.ERROR and result.output_text == "h"
    assert "entries" in result.ignored_actions[0].reason and "entries" in result.error


def test_a_bad_token_temp_on_a_lent_row_ends_the_request_with_a_reason():
    def adjust(event):
        arr = event.logits.to_numpy()
        return AdjustedLogits(type(event.logits).from_numpy(arr), token_temp=-1.0)

    result, _ = run([on(ForwardPass, adjust, step=1)])
    assert result.finish_reason is FinishReason.ERROR and result.output_text == "h"
    assert "token_temp" in result.error


def test_token_temp_zero_samples_greedily():
    # temperature 50 with top_k=0 would almost surely pick something other than the scripted char
    greedy = on(ForwardPass, lambda e: AdjustedLogits(e.logits, token_temp=0.0), once=False)
    result, _ = run([greedy], temperature=50.0, top_k=0, top_p=1.0, seed=3)
    assert result.output_text == "hello world"


def test_adjusted_prefill_replaces_the_prompt_and_honours_max_steps():
    result, _ = run([on(Prefilled, lambda e: AdjustedPrefill(ids("NEW PROMPT"), 3))])
    assert result.prompt_ids == ids("NEW PROMPT")
    assert len(result.output_ids) == 3 and result.finish_reason is FinishReason.LENGTH
    assert event_types(result).count("Prefilled") == 1  # not re-dispatched


def test_the_repetition_penalty_counts_the_adjusted_prompt_not_the_original():
    # the script wants "h" (logit 10) then "e" (5); a penalty of 3 takes "h" to 3.3 once "h" is seen
    eng = scripted_engine()

    def first_token(prompt: str, mods=()) -> str:
        handle = eng.submit(input_ids=ids(prompt), mods=list(mods), max_tokens=1, repetition_penalty=3.0)
        return handle.result(timeout=30).output_text

    try:
        assert first_token("Q:") == "h"
        assert first_token("Q:", [on(Prefilled, lambda e: AdjustedPrefill(ids("h"), 1))]) == "e"
        assert first_token("h") == "e"
        assert first_token("h", [on(Prefilled, lambda e: AdjustedPrefill(ids("Q:"), 1))]) == "h"  # "h" left
    finally:
        eng.close()


@pytest.mark.parametrize("event_cls,step", [(Prefilled, 0), (ForwardPass, 2), (Sampled, 2), (Added, 2)])
def test_force_output_replaces_the_whole_output(event_cls, step):
    result, _ = run([on(event_cls, lambda e: ForceOutput(ids("FORCED")), step=step)])
    assert result.output_text == "FORCED"
    assert result.finish_reason is FinishReason.STOP
    assert max(e.step for e in result.events) == step  # nothing after the terminal action


@pytest.mark.parametrize("event_cls", [Prefilled, ForwardPass, Sampled, Added])
def test_tool_calls_end_with_finish_reason_tool_calls(event_cls):
    payload = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    result, _ = run([on(event_cls, lambda e: ToolCalls(payload), step=0)])
    assert result.finish_reason is FinishReason.TOOL_CALLS
    assert result.tool_calls == [payload]
    assert result.output_text == ""


@pytest.mark.parametrize("event_cls", [Prefilled, ForwardPass, Sampled, Added])
def test_emit_error_ends_with_finish_reason_error(event_cls):
    result, _ = run([on(event_cls, lambda e: EmitError("nope"), step=0)])
    assert result.finish_reason is FinishReason.ERROR
    assert result.error == "nope"


def test_terminal_prefilled_action_runs_no_forward_pass():
    result, backend = run([on(Prefilled, lambda e: EmitError("stop"))])
    assert backend.forward_count == 1  # the prefill only
    assert event_types(result) == ["Prefilled"]


def test_terminal_action_short_circuits_later_mods_but_they_still_ran():
    calls = []

    def later(event, tokenizer=None):
        calls.append(type(event).__name__)
        print("later ran")
        return ForceTokens(ids("zzz")) if isinstance(event, ForwardPass) else None

    result, _ = run([on(ForwardPass, lambda e: ToolCalls({"x": 1}), step=0), later])
    assert "ForwardPass" in calls  # every registered mod is called for every event
    assert [type(i.action).__name__ for i in result.ignored_actions] == ["ForceTokens"]
    assert "ended processing" in result.ignored_actions[0].reason
    assert any("later ran" in log["log_message"] for log in result.payload["mod_logs"])


def test_raw_mod_force_tokens_at_prefilled_become_the_first_added_chunk():
    result, _ = run([on(Prefilled, lambda e: ForceTokens(ids("PRE")))])
    assert result.output_text.startswith("PRE")
    first_added = next(e for e in result.events if isinstance(e, Added))
    assert first_added.forced and first_added.added_tokens == ids("PRE")


def test_invalid_action_is_recorded_and_generation_goes_on():
    result, _ = run([on(Sampled, lambda e: AdjustedLogits(np.zeros((1, 128))), step=1)])
    assert result.output_text == "hello world"
    failed = [c for c in result.payload["mod_calls"] if c["exception_occurred"]]
    assert len(failed) == 1 and "not permitted for event Sampled" in failed[0]["exception_message"]


def test_mod_exception_becomes_noop_with_a_recorded_traceback():
    @mod
    def boom(event, actions, tokenizer):
        if isinstance(event, ForwardPass) and event.step == 1:
            raise RuntimeError("kaput")

    result, _ = run([boom])
    assert result.output_text == "hello world"
    (call,) = [c for c in result.payload["mod_calls"] if c["exception_occurred"]]
    assert "kaput" in call["exception_message"] and "Traceback" in call["exception_traceback"]
    assert any("Mod raised exception on ForwardPass" in log["log_message"] for log in result.payload["mod_logs"])


def test_eos_inside_a_forced_chunk_commits_the_chunk_then_stops():
    chunk = ids("ab") + [TOK.eos_token_id] + ids("cd")
    result, _ = run([on(ForwardPass, lambda e: ForceTokens(chunk), step=1)])
    assert result.output_text == "habcd"  # tokens after EOS are kept, the EOS is stripped
    assert result.finish_reason is FinishReason.STOP


def test_force_tokens_outside_the_vocabulary_end_the_request_with_an_error_naming_the_mod():
    result, _ = run([on(ForwardPass, lambda e: ForceTokens([5000]), step=1)])
    assert result.finish_reason is FinishReason.ERROR
    assert result.output_text == "h"  # what was generated before the fault is kept
    assert "mod on_ForwardPass_1" in result.error and "in [0, 128)" in result.error
    assert "in [0, 128)" in result.ignored_actions[0].reason


@pytest.mark.parametrize("bad,expected", [
    (lambda e: ForceTokens([-1]), "in [0, 128)"),
    (lambda e: Backtrack(-2, None), "must be >= 0"),
    (lambda e: AdjustedLogits(np.full((1, 128), np.nan, dtype=np.float32)), "NaN"),
    (lambda e: AdjustedLogits(np.full((1, 128), -np.inf, dtype=np.float32)), "-inf everywhere"),
    (lambda e: AdjustedLogits(e.logits, token_temp=float("nan")), "token_temp"),
    (lambda e: AdjustedLogits(e.logits, token_temp=-1.0), "token_temp"),
    (lambda e: AdjustedLogits(e.logits, token_temp=float("inf")), "token_temp"),
])
def test_unusable_action_values_end_the_request_never_the_loop(bad, expected):
    result, _ = run([on(ForwardPass, bad, step=2)])
    assert result.finish_reason is FinishReason.ERROR, result.output_text
    assert expected in result.error and "on_ForwardPass_2" in result.error
    assert result.output_text == "he"
    assert_payload_valid(result.payload)
    healthy, _ = run()  # positive control: the same engine code runs on
    assert healthy.output_text == "hello world"


def test_step_limit_stops_a_mod_that_backtracks_forever():
    forever = on(ForwardPass, lambda e: Backtrack(1, None), once=False)
    result, _ = run([forever], max_tokens=3, step_limit=20)
    assert result.finish_reason is FinishReason.LENGTH
    assert max(e.step for e in result.events) == 19


def test_prefilled_context_info_carries_what_legacy_mods_read():
    seen = {}

    def reader(event, tokenizer=None):
        if isinstance(event, Prefilled):
            info = event.context_info
            seen["text"] = tokenizer.decode(info.tokens[: info._prompt_len])
            seen["max_steps"] = event.max_steps
        return None

    run([reader], prompt="Say hi", max_tokens=7)
    assert seen == {"text": "Say hi", "max_steps": 7}


@pytest.mark.parametrize("event_cls,factory,field", [
    (ForwardPass, lambda e: Backtrack(1, [9999]), "Backtrack.tokens"),
    (Prefilled, lambda e: AdjustedPrefill([1, 9999], 0), "AdjustedPrefill.tokens"),
    (Sampled, lambda e: ForceOutput([9999]), "ForceOutput.tokens"),
])
def test_out_of_vocabulary_ids_in_any_action_end_the_request_with_a_reason(event_cls, factory, field):
    result, _ = run([on(event_cls, factory, step=0)])
    assert result.finish_reason is FinishReason.ERROR
    (ignored,) = result.ignored_actions
    assert ignored.reason.startswith(f"`{field}[")
    assert "must be a token id in [0, 128)" in ignored.reason and field in result.error


def test_the_builder_validation_and_the_phases_read_one_table_of_allowed_actions():
    """Every (event, action) pair the table allows: the SDK builder permits it and each phase of
    the machine applies it (never 'not allowed'); every pair it refuses: the builder refuses it and
    the phase records it as ignored. The table is the only statement of either."""
    import inspect

    from mods.types import Steer

    from engine.core import actions as phase_rules
    from mods.actions import ActionBuilder
    from mods.validation import ALLOWED_ACTIONS, InvalidActionError, allowed_actions

    builders = {"force_output": ForceOutput, "tool_calls": ToolCalls, "adjust_prefill": AdjustedPrefill,
                "adjust_logits": AdjustedLogits, "force_tokens": ForceTokens, "backtrack": Backtrack,
                "steer": Steer}
    events = {Prefilled: Prefilled("r", 0, 4, None), ForwardPass: ForwardPass("r", 1, np.zeros((1, 4))),
              Sampled: Sampled("r", 1, 2), Added: Added("r", 1, [2], False)}
    args = {"force_output": ([1],), "tool_calls": ({},), "adjust_prefill": ([1],), "adjust_logits": (np.zeros((1, 4)),),
            "force_tokens": ([1],), "backtrack": (1,), "steer": (0, 1.0)}
    checked = 0
    for event_cls, event in events.items():
        assert allowed_actions(event) == ALLOWED_ACTIONS[event_cls]
        for method, action_cls in builders.items():
            allowed = issubclass(action_cls, ALLOWED_ACTIONS[event_cls])
            builder = ActionBuilder(event)
            if allowed:
                assert isinstance(getattr(builder, method)(*args[method]), action_cls)
            else:
                with pytest.raises(InvalidActionError, match="not permitted"):
                    getattr(builder, method)(*args[method])
            checked += 1
    assert checked == 28
    # the phases name no action list of their own: each reads its event's row of the table
    source = inspect.getsource(phase_rules.PhaseActions)
    assert source.count("ALLOWED_ACTIONS[event]") == 1 and "has no effect at" not in source


def test_a_said_mask_reads_and_samples_exactly_as_the_numpy_edit_it_stands_for():
    """MaskedLogits (what SelfPrompt's strategies and mods.features return) is applied by the
    engine where the logits are, with no host copy; reading it gives the numpy edit of the event's
    logits, and a run masked that way is token for token the run masked by the numpy edit."""
    from mods.tensor import MaskedLogits

    allowed = set(TOK.encode("held ow"))  # the script wants "hello world": 'l' is not allowed

    def said(event, tokenizer=None):
        if isinstance(event, ForwardPass):
            masked = MaskedLogits(event.logits, allowed=sorted(allowed) + [10_000], value=-1e9)
            expected = event.logits.to_numpy().copy()
            expected[0, [t for t in range(expected.shape[1]) if t not in allowed]] = -1e9
            assert np.array_equal(masked.to_numpy(), expected) and masked.shape == (1, expected.shape[1])
            return AdjustedLogits(masked)
        return None

    def done(event, tokenizer=None):
        if isinstance(event, ForwardPass):
            logits = event.logits.to_numpy().copy()
            logits[0, [t for t in range(logits.shape[1]) if t not in allowed]] = -1e9
            return AdjustedLogits(type(event.logits).from_numpy(logits))
        return None

    plain = scripted_engine("hello world").generate(input_ids=TOK.encode("Q:"))
    runs = [scripted_engine("hello world").generate(input_ids=TOK.encode("Q:"), mods=[m]) for m in (said, done)]
    assert runs[0].sequence_ids == runs[1].sequence_ids != plain.sequence_ids  # positive control: it changed
    assert all(t in allowed or t == TOK.eos_token_id for t in runs[0].sequence_ids)
    shapes = [[a["logits_shape"] for a in r.payload["actions"]] for r in runs]
    assert shapes[0] == shapes[1] and shapes[0]
