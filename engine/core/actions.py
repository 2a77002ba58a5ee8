"""What a request's mod actions do, phase by phase: one ``apply_<phase>_actions`` per phase, one
case per action the phase allows. The rules, with their deliberate deviations (DEV) from the
original engine, are stated once in ``docs/generation-rules.md``; this module is where each of
them is applied, and nowhere else.

Processing a phase's actions goes in mod registration order and ends at the first Backtrack,
AdjustedPrefill or terminal action; every non-Noop action after that point is recorded as ignored,
never dropped silently. A value the engine cannot use is a fault that ends this request alone.

:class:`PhaseActions` sees one request (:class:`~engine.core.request.RequestState`); its state
machine (:class:`~engine.core.machine.RequestMachine`) calls it with each phase's mod calls.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from engine.core.events import released_logits
from engine.core.request import RequestState
from engine.core.result import FinishReason, IgnoredAction
from engine.model.sampling import SamplingParams
from engine.model.tensor import HostLogits, TensorShim, as_torch, logits_dims
from mods.manager import ModCall
from mods.tensor import MaskedLogits
from mods.validation import ALLOWED_ACTIONS, InvalidActionError, check_action_values, check_steer, check_token_ids
from mods.types import (
    Added,
    AdjustedLogits,
    AdjustedPrefill,
    Backtrack,
    EmitError,
    ForceOutput,
    ForceTokens,
    ForwardPass,
    ModAction,
    ModEvent,
    Noop,
    Prefilled,
    Sampled,
    Steer,
    ToolCalls,
)

__all__ = ["PhaseActions", "StepPlan", "SteerSource", "Call"]


class SteerSource(Protocol):
    """Where Steer actions get their directions (the engine's loaded SAE)."""

    layer: int
    num_features: int

    def delta(self, steers: dict[int, float]) -> Any: ...


@dataclass(slots=True)
class Call:
    """One mod call of a phase and its position in the payload's mod_calls (when recorded)."""

    call: ModCall
    index: int | None


@dataclass(slots=True)
class StepPlan:
    """What the ForwardPass/Sampled phase decided for the rest of the step (one a step per
    request with mods: slotted, no default factory)."""

    logits: Any = None  # AdjustedLogits replacement (V,), torch, on device
    argmax: Any = None  # its argmax (an int, or 0-d on device), found by the validity check's one pass
    sampling: SamplingParams | None = None
    backtracked: bool = False
    reinject: list[int] | None = None  # a Backtrack's tokens to add instead of a sample
    # an AdjustedLogits of a lent row whose check waits for the step's draw (PhaseActions.settle)
    unchecked: tuple[Call, tuple[HostLogits, int]] | None = None


class PhaseActions:
    """Applies one request's mod actions. It refers to the request's state only, never back to its
    machine: a machine that the actions referred back to would make every finished request a
    reference cycle, its events and internals freed only by the garbage collector's full passes
    (tens of ms each, inside some later step)."""

    def __init__(self, state: RequestState, *, vocab_size: int, device: torch.device,
                 steering: SteerSource | None) -> None:
        self.state = state
        self.vocab_size = vocab_size
        self.device = device
        self._on_cpu = device.type == "cpu"  # a mod's row of the step's host copy is then usable as it is
        self.steering = steering
        self.steer_log: list[dict[str, Any]] = []  # every applied Steer: step, feature, scale

    def commit_silently(self, tokens: list[int]) -> None:
        """Forced tokens with no Added of their own (an Added-phase ForceTokens, Backtrack's tokens)."""
        self.state.commit(tokens, forced=True)

    # ------------------------------------------------------------------------------ records

    def applied(self, item: Call, note: str | None = None, action: ModAction | None = None) -> None:
        action = action if action is not None else item.call.action
        state = self.state
        if not isinstance(action, AdjustedLogits):
            state.actions.append(action)
            state.payload.action(item.index, action, applied=True, note=note)
            return
        dims = logits_dims(action.logits)  # read once, for its record and its released copy
        # an AdjustedLogits holds a row of the step's host copy, which keeps the whole copy alive
        state.actions.append(action if state.request.keep_logits
                             else released_logits(action, state.step, dims if dims is not None else ()))
        state.payload.action(item.index, action, applied=True, note=note, dims=dims)

    def ignored(self, item: Call, reason: str, action: ModAction | None = None) -> None:
        action = action if action is not None else item.call.action
        self.state.ignored.append(IgnoredAction(self.state.step, item.call.event_type, item.call.mod_name, action,
                                                reason))
        self.state.payload.action(item.index, action, applied=False, note=reason)

    def ignore_rest(self, rest: Sequence[Call], after: ModAction) -> None:
        for item in rest:
            if not isinstance(item.call.action, Noop):
                self.ignored(item, f"a {type(after).__name__} earlier in this phase ended processing")

    def fault(self, item: Call, reason: str, action: ModAction | None = None) -> None:
        """A mod handed back a value the engine cannot use: the action is recorded as not applied
        and the request ends with finish reason ``error`` naming the mod (its neighbours go on)."""
        action = action if action is not None else item.call.action
        self.ignored(item, reason, action)
        self.state.fail(f"mod {item.call.mod_name} returned an unusable {type(action).__name__} at "
                        f"{item.call.event_type} step {self.state.step}: {reason}")

    def valid(self, item: Call, action: ModAction | None = None) -> bool:
        """Every value of the action checked before it is applied (token ids in the vocabulary,
        finite logits, a usable temperature); a bad one is a :meth:`fault`."""
        action = action if action is not None else item.call.action
        try:
            check_action_values(action, self.vocab_size, logits=False)
        except InvalidActionError as err:
            self.fault(item, str(err), action)
            return False
        return True

    def valid_ids(self, item: Call, ids: Sequence[int] | None, what: str) -> list[int] | None:
        """``ids`` as ints if all are token ids in the vocabulary; otherwise a :meth:`fault`."""
        try:
            return check_token_ids(ids if ids is not None else [], self.vocab_size, field=what)
        except InvalidActionError as err:
            self.fault(item, str(err))
            return None

    def check_fatal_calls(self, calls: Sequence[Call]) -> bool:
        """A call that timed out or raised a BaseException ends the request (the mod cannot be
        trusted to go on); True when the request may continue."""
        for item in calls:
            call = item.call
            if getattr(call, "fatal", False):
                what = call.exception.message if call.exception is not None else "failed"
                kind = call.exception.type if call.exception is not None else "error"
                self.state.fail(f"mod {call.mod_name} failed on {call.event_type} step {call.step}: {kind}: {what}")
                return False
        return True

    # ------------------------------------------------------------------------ shared effects

    def accept_force(self, item: Call, action: ForceTokens) -> list[int] | None:
        """The ForceTokens ids if this is the step's first and they are valid, else None (ignored)."""
        if self.state.force_accepted:
            self.ignored(item, "a ForceTokens was already accepted this step (one per step)", action)
            return None
        ids = self.valid_ids(item, action.tokens, "ForceTokens.tokens")
        if ids is not None:
            self.state.force_accepted = True
            self.applied(item, action=action)
        return ids

    def queue_force(self, item: Call, action: ForceTokens) -> None:
        ids = self.accept_force(item, action)
        if ids:
            self.state.forced_queue.extend(ids)

    def finish_terminal(self, item: Call) -> bool:
        """Apply a terminal action; False when it was ignored (bad token ids)."""
        action, state = item.call.action, self.state
        if isinstance(action, ForceOutput):
            ids = self.valid_ids(item, action.tokens, "ForceOutput.tokens")
            if ids is None:
                return False
            state.finish_with(FinishReason.STOP, output=ids)
        elif isinstance(action, ToolCalls):
            state.finish_with(FinishReason.TOOL_CALLS, tool_calls=[action.tool_calls])
        else:
            state.finish_with(FinishReason.ERROR, error=str(getattr(action, "err_str", "")))
        self.applied(item)
        return True

    def backtrack(self, item: Call, already_erased: int) -> list[int] | None:
        """Erase per the phase rule; the tokens to reinject (None if the action was ignored)."""
        action: Backtrack = item.call.action  # type: ignore[assignment]
        if not self.valid(item):
            return None
        reinject = [int(t) for t in action.tokens or []]
        wanted = max(0, int(action.n) - already_erased)
        erase = min(wanted, len(self.state.generated))
        self.state.erase(erase)
        self.applied(item, None if erase == wanted else f"erased {erase} of {wanted}: prompt tokens are kept")
        return reinject

    def adjust_logits(self, item: Call, action: AdjustedLogits, plan: StepPlan, *, last: bool = False) -> None:
        """A mod's replacement logits for this step's draw, checked first. ``last``: no action of
        the phase follows; then the check of a lent row (the usual edit-and-return) is left to
        :meth:`settle`, just before the draw."""
        vocab = self.vocab_size
        # the only value checked before the logits is token_temp: None, 0 (greedy) or finite > 0
        if action.token_temp is not None and not self.valid(item):
            return
        source = action.logits
        shim = type(source) is TensorShim
        # a whole row of the step's host copy, as a mod left it (the usual edit-and-return)
        lent = source.lent if shim else getattr(source, "lent", None)
        whole_row = False  # a whole row of the batch: of the vocabulary's size (HostLogits.slot_of places only those)
        try:
            if shim and lent is not None and self._on_cpu:  # float32 on the engine's device already: as it is
                logits, whole_row = source.tensor, True
            elif isinstance(source, MaskedLogits):  # said, not done: applied here, where the logits are
                row = as_torch(source.base, device=self.device, dtype=torch.float32).reshape(-1)
                mask = torch.from_numpy(source.mask()).to(self.device)  # (V,) bool
                logits = row.masked_fill(mask, source.value)
            else:
                logits = as_torch(source, device=self.device, dtype=torch.float32).reshape(-1)
        except Exception as err:  # a mod handed us something that is not a tensor
            return self.fault(item, f"AdjustedLogits.logits is not a tensor of numbers: {err}")
        if not whole_row and logits.numel() != vocab:
            return self.fault(item, f"AdjustedLogits.logits must have {vocab} entries ([1, V] or [V]), "
                                    f"got {logits.numel()}")
        temp = action.token_temp
        base = self.state.request.sampling
        plan.logits = logits
        plan.sampling = base if temp is None else dataclasses.replace(base, temperature=float(temp))
        if lent is not None and last and not self.state.forced_queue:
            # checked by settle(), once every request's ForwardPass actions are applied; recorded
            # as applied now, the usual outcome (taken back there if the check fails)
            plan.unchecked = (item, lent)
            self.applied(item)
            return
        # one pass and one device read: the maximum is finite unless there is a NaN (max propagates
        # it) or a +inf anywhere, or nothing but -inf — none of which can be sampled from; the same
        # pass finds the greedy choice (the first maximum, as argmax picks it)
        if lent is not None:  # Python numbers, read with every other lent row's
            best, where = lent[0].row_max(lent[1])
        else:
            best, where = logits.max(0)
            best = float(best)
        if not math.isfinite(best):
            return self._unusable(item)
        plan.argmax = where
        self.applied(item)

    def settle(self, plan: StepPlan) -> bool:
        """The check :meth:`adjust_logits` left to the step's draw: the maximum of the row a mod
        handed back is finite, and its first index is the greedy choice (the first such check of a
        step searches every row handed back in one pass, :meth:`HostLogits.row_max`). False when it
        is not: the action's record as applied is taken back and the request ends, as a check in
        the phase would have ended it."""
        item, lent = plan.unchecked  # type: ignore[misc]
        plan.unchecked = None
        best, where = lent[0].row_max(lent[1])
        if math.isfinite(best):
            plan.argmax = where
            return True
        state = self.state
        state.actions.pop()
        state.payload.take_back_action(item.index)
        self._unusable(item)
        return False

    def _unusable(self, item: Call) -> None:
        self.fault(item, "AdjustedLogits.logits must be finite numbers (-inf allowed) with at least one "
                         "finite entry; got NaN, +inf or -inf everywhere")

    def steer(self, item: Call, action: Steer) -> None:
        """Set (or with scale 0 remove) the request's steer of one feature; every later forward of
        this request adds the summed directions at the SAE's layer."""
        if self.steering is None:
            return self.fault(item, "Steer needs the engine's SAE loaded (sae.enabled); none is")
        try:
            feature, scale = check_steer(action, num_features=self.steering.num_features)
        except InvalidActionError as err:
            return self.fault(item, str(err))
        state = self.state
        if scale == 0.0:
            state.steers.pop(feature, None)
        else:
            state.steers[feature] = scale
        state.steer_delta = self.steering.delta(state.steers) if state.steers else None
        self.steer_log.append({"step": state.step, "feature_id": feature, "scale": scale})
        self.applied(item)

    # -------------------------------------------------------------------------------- phases

    def _allowed(self, item: Call, event: type[ModEvent]) -> bool:
        """Whether ``event``'s row of the one table of allowed actions lists the call's action (the
        SDK and mod validation read the same row, so a refused one cannot come from a mod; a
        non-Noop one is recorded as ignored, never dropped)."""
        action = item.call.action
        if isinstance(action, ALLOWED_ACTIONS[event]):
            return True
        self.ignored(item, f"{type(action).__name__} is not allowed at {event.__name__}")
        return False

    def apply_prefilled_actions(self, calls: list[Call]) -> None:
        state = self.state
        for i, item in enumerate(calls):
            action = item.call.action
            if isinstance(item.call.rejected, ForceTokens):  # a raw mod's ForceTokens at Prefilled: queued
                self.queue_force(item, item.call.rejected)
                continue
            if not self._allowed(item, Prefilled):
                continue
            match action:
                case Noop():
                    continue
                case AdjustedPrefill():
                    tokens = self.valid_ids(item, action.tokens, "AdjustedPrefill.tokens")
                    if tokens is None:
                        continue
                    if int(action.max_steps or 0) > 0:
                        state.max_tokens = int(action.max_steps)
                    if tokens:
                        state.replace_prompt(tokens)
                    self.applied(item)
                    return self.ignore_rest(calls[i + 1:], action)
                case ForceOutput() | ToolCalls() | EmitError():
                    if self.finish_terminal(item):
                        return self.ignore_rest(calls[i + 1:], action)
                case _:  # the table lists an action this phase has no case for
                    raise AssertionError(f"Prefilled allows {type(action).__name__} but applies no such action")

    def apply_forward_pass_actions(self, calls: list[Call]) -> StepPlan:
        return self._apply_step_actions(calls, ForwardPass, already_erased=0)

    def apply_sampled_actions(self, calls: list[Call]) -> StepPlan:
        # the pending sample is erased first by a Backtrack here
        return self._apply_step_actions(calls, Sampled, already_erased=1)

    def _apply_step_actions(self, calls: list[Call], event: type[ModEvent], *, already_erased: int) -> StepPlan:
        """ForwardPass and Sampled take the same actions, except that only ForwardPass may adjust
        logits (the table's rows say so) and that at Sampled a Backtrack also drops the token
        just sampled."""
        plan = StepPlan()
        for i, item in enumerate(calls):
            action = item.call.action
            if not self._allowed(item, event):
                continue
            match action:
                case Noop():
                    continue
                case AdjustedLogits():
                    self.adjust_logits(item, action, plan, last=i == len(calls) - 1)
                case Steer():
                    self.steer(item, action)
                case ForceTokens():
                    self.queue_force(item, action)
                case Backtrack():
                    reinject = self.backtrack(item, already_erased=already_erased)
                    if reinject is not None:
                        plan.backtracked, plan.reinject = True, reinject
                        self.ignore_rest(calls[i + 1:], action)
                        return plan
                case ForceOutput() | ToolCalls() | EmitError():
                    if self.finish_terminal(item):
                        self.ignore_rest(calls[i + 1:], action)
                        return plan
                case _:  # the table lists an action this phase has no case for
                    raise AssertionError(f"{event.__name__} allows {type(action).__name__} but applies no such action")
        return plan

    def apply_added_actions(self, calls: list[Call]) -> None:
        for i, item in enumerate(calls):
            action = item.call.action
            if not self._allowed(item, Added):
                continue
            match action:
                case Noop():
                    continue
                case Steer():
                    self.steer(item, action)
                case ForceTokens():
                    ids = self.accept_force(item, action)
                    if ids:
                        self.commit_silently(ids)  # a silent continuation
                case Backtrack():
                    reinject = self.backtrack(item, already_erased=0)
                    if reinject is not None:
                        if reinject:
                            self.commit_silently(reinject)
                        return self.ignore_rest(calls[i + 1:], action)
                case ForceOutput() | ToolCalls() | EmitError():
                    if self.finish_terminal(item):
                        return self.ignore_rest(calls[i + 1:], action)
                case _:  # the table lists an action this phase has no case for
                    raise AssertionError(f"Added allows {type(action).__name__} but applies no such action")
