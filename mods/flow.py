"""FlowEngine: a graph of self-prompted questions with routes (legacy name ``quote_mod_sdk.flow``).

Each :class:`FlowQuestion` is asked through a SelfPrompt. When its answer is complete, the
answer is stored (``state.answers[name]``), its assignments run, and its route is taken: another
question (asked at once on a ForwardPass, at the next one after an Added), a message or summary
(forced, ending with EOS), a tool callback, a ForceOutput, or nothing.

Kept from the original because production mods touch them: ``_states`` and ``_get_state``, the
SelfPrompt cache keyed by question *name* (a later question object with the same name but a
different prompt or strategy reuses the cached SelfPrompt), Prefilled resetting the flow to the
entry question, and a TOOL callback that raises being called again with only the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Callable, Dict, Generic, List, Optional, Protocol, TypeVar, Union, cast, runtime_checkable

from .actions import ActionBuilder
from .self_prompt import EraseMode, SelfPrompt
from .strategies.strategy_constructor import StrategyConstructor
from .types import Added, Backtrack, ForwardPass, ModAction, Prefilled

__all__ = [
    "FlowQuestion",
    "FlowDefinition",
    "FlowRoute",
    "FlowState",
    "RouteKind",
    "RouteTarget",
    "route_question",
    "route_message",
    "route_summary",
    "route_tool",
    "route_noop",
    "route_output",
    "FlowEngine",
    "RequestState",
]

TState = TypeVar("TState", bound="FlowState")

RouteTarget = Any  # a question, a flow, a route, a callable, a message string, or None


class RouteKind(Enum):
    QUESTION = auto()
    MESSAGE = auto()
    SUMMARY = auto()
    OUTPUT = auto()
    TOOL = auto()
    NOOP = auto()


@dataclass
class FlowRoute(Generic[TState]):
    kind: RouteKind
    target: Any = None
    message: Optional[str] = None
    callback: Optional[Callable[..., Any]] = None


@runtime_checkable
class FlowState(Protocol):
    request_id: str
    current_question: Optional["FlowQuestion"]
    pending_route: Optional[FlowRoute]
    answers: Dict[str, str]
    data: Dict[str, Any]


RouteSpec = Union["FlowQuestion[TState]", Callable[[TState], RouteTarget]]


def route_question(question: "FlowQuestion[TState]") -> FlowRoute[TState]:
    return FlowRoute(RouteKind.QUESTION, target=question)


def route_message(text: str) -> FlowRoute[TState]:
    return FlowRoute(RouteKind.MESSAGE, message=text)


def route_output(text: str) -> FlowRoute[TState]:
    return FlowRoute(RouteKind.OUTPUT, message=text)


def route_summary(message: Optional[str] = None) -> FlowRoute[TState]:
    return FlowRoute(RouteKind.SUMMARY, message=message)


def route_noop() -> FlowRoute[TState]:
    return FlowRoute(RouteKind.NOOP)


def route_tool(callback: Callable[..., Any]) -> FlowRoute[TState]:
    return FlowRoute(RouteKind.TOOL, callback=callback)


def _coerce_route(target: RouteTarget) -> FlowRoute:
    if isinstance(target, FlowRoute):
        return target
    if isinstance(target, FlowQuestion):
        return route_question(target)
    if isinstance(target, FlowDefinition):
        return route_question(target.root)
    if callable(target):
        return FlowRoute(RouteKind.TOOL, callback=target)
    if isinstance(target, str):
        return route_message(target)
    if target is None:
        return FlowRoute(RouteKind.NOOP)
    raise ValueError(f"Unsupported route target: {target!r}")


@dataclass
class FlowQuestion(Generic[TState]):
    name: str
    prompt: str
    strategy: StrategyConstructor
    completion_text: str = "\n"
    erase_mode: Optional[EraseMode] = EraseMode.NONE
    assignments: List[Callable[[TState, str], None]] = field(default_factory=list)
    transitions: Dict[str, RouteSpec] = field(default_factory=dict)
    branch_resolvers: List[Callable[[TState], Optional[RouteSpec]]] = field(default_factory=list)
    default_route: Optional[RouteSpec] = None

    def on(self, answer: str, target: RouteSpec) -> "FlowQuestion[TState]":
        self.transitions[answer.lower()] = target
        return self

    def then(self, target: RouteSpec) -> "FlowQuestion[TState]":
        self.default_route = target
        return self

    def otherwise(self, target: RouteSpec) -> "FlowQuestion[TState]":
        self.default_route = target
        return self

    def assign(self, func: Callable[[TState, str], None]) -> "FlowQuestion[TState]":
        self.assignments.append(func)
        return self

    def branch(self, resolver: Callable[[TState], Optional[RouteSpec]]) -> "FlowQuestion[TState]":
        self.branch_resolvers.append(resolver)
        return self

    def with_auto_answer(self, func: Callable[[TState], Optional[str]]) -> "FlowQuestion[TState]":
        self.auto_answer_fn = func
        return self

    def resolve_route(self, state: TState, answer: Optional[str] = None) -> Optional[FlowRoute]:
        """The route for ``answer``: its transition, else the default; else the first branch
        resolver that yields one. Callables are called with the state until a target remains."""
        spec: Any = None
        if answer is not None:
            try:
                spec = self.transitions.get(answer.lower())
            except Exception:
                spec = None
        if spec is None:
            spec = self.default_route
        if spec is None:
            for resolver in list(self.branch_resolvers):
                try:
                    target = resolver(state)
                except Exception:
                    continue
                while callable(target) and not isinstance(target, (FlowQuestion, FlowDefinition, FlowRoute)):
                    try:
                        target = target(state)
                    except Exception as err:
                        print("error when getting next route:", err, type(target))
                        break
                if target is not None:
                    return _coerce_route(target)
            return None
        while callable(spec) and not isinstance(spec, (FlowQuestion, FlowDefinition, FlowRoute)):
            spec = spec(state)  # errors propagate, as in the original
        return None if spec is None else _coerce_route(spec)


@dataclass
class FlowDefinition(Generic[TState]):
    name: str
    root: FlowQuestion[TState]
    summary_builder: Callable[[TState], str]

    def all_questions(self) -> List[FlowQuestion]:
        """Every question reachable from the root (callables probed with an empty state)."""
        seen: set[int] = set()
        order: List[FlowQuestion] = []
        stack: List[FlowQuestion] = [self.root]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            order.append(node)
            specs = list(node.transitions.values()) + ([node.default_route] if node.default_route is not None else [])
            for spec in specs:
                try:
                    route = _coerce_route(spec(RequestState("__introspect__")) if callable(spec) and not isinstance(
                        spec, (FlowQuestion, FlowDefinition, FlowRoute)) else spec)
                except Exception:
                    continue
                if route.kind == RouteKind.QUESTION and isinstance(route.target, FlowQuestion):
                    stack.append(route.target)
        return order


@dataclass
class RequestState:
    request_id: str
    current_question: Optional[FlowQuestion] = None
    pending_route: Optional[FlowRoute] = None
    answers: Dict[str, str] = field(default_factory=dict)
    data: Dict[str, Any] = field(default_factory=dict)


def _encode(tokenizer: Any, text: str) -> List[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


class FlowEngine(Generic[TState]):
    def __init__(self, *, entry_question: FlowQuestion[TState],
                 flows: Optional[Dict[str, FlowDefinition[TState]]] = None,
                 state_factory: Optional[Callable[[str], TState]] = None) -> None:
        self.entry_question = entry_question
        self.flows = dict(flows) if flows else {}
        self._constraints: Dict[str, SelfPrompt] = {}
        self._states: Dict[str, TState] = {}
        self._state_factory: Callable[[str], TState] = state_factory or (
            lambda rid: cast(TState, RequestState(request_id=rid)))

    def _get_state(self, request_id: str) -> TState:
        state = self._states.get(request_id)
        if state is None:
            state = self._states[request_id] = self._state_factory(request_id)
        return state

    def _ensure_constraint(self, question: FlowQuestion) -> SelfPrompt:
        helper = self._constraints.get(question.name)
        if helper is None:
            helper = self._constraints[question.name] = SelfPrompt(
                prompt={"text": question.prompt}, strategy=question.strategy, completion=question.completion_text,
                erase=question.erase_mode or EraseMode.NONE, mask_value=-1e9)
        return helper

    # --------------------------------------------------------------------------------- routes

    def _forced_text(self, state: TState, text: str, actions: ActionBuilder, tokenizer: Any) -> ModAction:
        """Force ``text`` and end the turn with EOS (when the tokenizer has one)."""
        tokens = _encode(tokenizer, text)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None:
            tokens.append(int(eos))
            state.current_question = None
        return actions.force_tokens(tokens)

    def _summary(self, state: TState, question: Optional[FlowQuestion], route: FlowRoute) -> str:
        for flow in self.flows.values():
            if question is not None and question in flow.all_questions():
                return flow.summary_builder(state)
        return route.message or "Flow complete."

    def _perform_route(self, event: Any, state: TState, current: Optional[FlowQuestion], route: FlowRoute,
                       actions: ActionBuilder, tokenizer: Any) -> ModAction:
        if route.kind == RouteKind.QUESTION and isinstance(route.target, FlowQuestion):
            nxt = route.target
            auto = self._resolve_auto_route(state, nxt)
            if auto is not None:
                return self._perform_route(event, state, current, auto, actions, tokenizer)
            state.current_question = nxt
            helper = self._ensure_constraint(nxt)
            if isinstance(event, ForwardPass):
                print(f"[Flow] next question={nxt.name}")
                return helper.handle_forward_pass(event, actions, tokenizer)
            return actions.noop()
        if route.kind == RouteKind.MESSAGE:
            return self._forced_text(state, route.message or "", actions, tokenizer)
        if route.kind == RouteKind.SUMMARY:
            return self._forced_text(state, self._summary(state, current, route), actions, tokenizer)
        if route.kind == RouteKind.TOOL and route.callback:
            try:
                return route.callback(actions, state, tokenizer)
            except Exception as err:
                print("error calling standard callback", err)
                again = _coerce_route(route.callback(state))
                return self._perform_route(event, state, current, again, actions, tokenizer)
        if route.kind == RouteKind.OUTPUT:
            return actions.force_output(_encode(tokenizer, route.message or ""))
        return actions.noop()

    def _resolve_auto_route(self, state: TState, question: FlowQuestion) -> Optional[FlowRoute]:
        auto = getattr(question, "auto_answer_fn", None)
        if not callable(auto):
            return None
        try:
            answer = auto(state)
        except Exception:
            answer = None
        if not (isinstance(answer, str) and answer.strip()):
            return None
        answer = answer.strip()
        state.answers[question.name] = answer
        for assign in question.assignments:
            try:
                assign(state, answer)
            except Exception:
                pass
        return question.resolve_route(state, answer)

    def _advance_on_completion(self, *, event: Any, state: TState, question: FlowQuestion, last_action: Any,
                               actions: ActionBuilder, tokenizer: Any) -> ModAction:
        helper = self._ensure_constraint(question)
        cstate = helper._states.get(state.request_id)
        if cstate is None or not cstate.completed or isinstance(last_action, Backtrack):
            return last_action if last_action is not None else actions.noop()
        tokens = list(cstate.answer_tokens or [])
        answer = tokenizer.decode(tokens, skip_special_tokens=True) if tokens else None
        answer = answer or None
        print(f'ANSWER: {question.name}: "{answer}"')
        if isinstance(answer, str):
            state.answers[question.name] = answer
            for assign in question.assignments:
                assign(state, answer)
        route = question.resolve_route(state, answer)
        if not route:
            return last_action if last_action is not None else actions.noop()
        return self._perform_route(event, state, question, route, actions, tokenizer)

    # --------------------------------------------------------------------------------- events

    def handle_event(self, event: Any, actions: ActionBuilder, tokenizer: Any) -> ModAction:
        request_id = getattr(event, "request_id", None)
        if not isinstance(request_id, str) or tokenizer is None:
            return actions.noop()
        state = self._get_state(request_id)
        if isinstance(event, Prefilled):
            self._ensure_constraint(self.entry_question).handle_prefilled(event, tokenizer)
            print(f"[Flow] Prefilled: entry_question={self.entry_question.name}")
            state.current_question = self.entry_question
            state.pending_route = None
            return actions.noop()
        if isinstance(event, ForwardPass):
            question = state.current_question
            if state.pending_route is not None:
                route, state.pending_route = state.pending_route, None
                return self._perform_route(event, state, question, route, actions, tokenizer)
            if question is None:
                return actions.noop()
            action = self._ensure_constraint(question).handle_forward_pass(event, actions, tokenizer)
            return self._advance_on_completion(event=event, state=state, question=question, last_action=action,
                                               actions=actions, tokenizer=tokenizer)
        if isinstance(event, Added):
            question = state.current_question
            if question is None:
                return actions.noop()
            added = self._ensure_constraint(question).handle_added(event, actions, tokenizer)
            return self._advance_on_completion(event=event, state=state, question=question, last_action=added,
                                               actions=actions, tokenizer=tokenizer)
        return actions.noop()
