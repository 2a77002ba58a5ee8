"""Which events a mod would turn away without doing anything, read from its handler's own code.

The SDK calls every mod for every event of its request, and most mods act on one or two kinds:

    @mod
    def ban(event, actions, tokenizer):
        if isinstance(event, ForwardPass):
            ...
        return None

For a Sampled or Added event such a call does nothing but return ``None`` (a Noop), yet the engine
pays for it as for any call: a round of calls, a capture buffer, a timer (at 64 concurrent
requests on two cores, those calls and the two thread hand-offs each round then cost took 0.5-0.7
ms of a 20 ms step, and a step with no call for an event makes no round for it at all). So, before
a call, the engine runs the handler's leading guard itself, exactly as the handler would: the
instructions from the start of its code that test the event parameter with ``isinstance`` against
classes (``if``/``elif`` chains, ``and``/``or``, ``if not isinstance(...): return None``), with the
names in them resolved now as the handler would resolve them. When the guard leads straight to
``return None``, the call would have returned a Noop having done nothing else; it is not made.

Anything the guard does not cover means the call is made, as always: any other instruction before
the guard has decided (a print, a counter, a ``with``), a name that is unbound or is not a plain
class (a class whose metaclass defines its own instance check could run code), ``isinstance``
rebound, a module attribute the module does not hold itself, a generator or coroutine function,
an argument list the call would not bind to, or a mod that is neither a plain function nor the
SDK's ``@mod``/``create_mod`` wrapper of one (the wrapper's own work before and after the handler,
an action builder and the result's validation, does nothing for a ``None``). Names are resolved
when the event is dispatched, before the round's calls run; for the SDK's four event classes the
answer depends on the class alone, so it is reused for the next events of that class until code
that could rebind a name runs (:func:`forget_decisions`: every mod call, every event listener, and
each step) — a step at 64 concurrent requests with one shared mod asks three questions, not 192.
"""

from __future__ import annotations

import builtins
import dis
import inspect
import types
import weakref
from typing import Any, Callable, Sequence

from .types import Added, ForwardPass, Prefilled, Sampled

__all__ = ["turns_away", "turns_away_kind", "turns_away_all", "forget_decisions"]

_INERT = frozenset({"NOP", "RESUME", "COPY_FREE_VARS", "MAKE_CELL", "NOT_TAKEN", "EXTENDED_ARG"})
_IF_FALSE = frozenset({"POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_FALSE"})
_IF_TRUE = frozenset({"POP_JUMP_IF_TRUE", "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_TRUE"})
_NOT_PLAIN = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ITERABLE_COROUTINE | inspect.CO_ASYNC_GENERATOR
_MAX_TESTS = 32  # a guard longer than this is not read (the call is made)

# A program: per position, ("none",) — return None here; ("test", refs, jump_if, target, next) —
# isinstance(event, refs), then to ``target`` when it equals ``jump_if``, else to ``next``;
# ("other",) — anything else.
# A ref: ("global", name), ("deref", name, free variable index or -1) or ("attr", module global, name).
_Ref = tuple[Any, ...]
_Op = tuple[Any, ...]
_OTHER: _Op = ("other",)
_PROGRAMS: dict[int, tuple[types.CodeType, tuple[_Op, ...] | None]] = {}


def turns_away(mod: Callable[..., Any], event: Any) -> bool:
    """True when calling ``mod(event, tokenizer)`` (as the mod manager calls it) would return
    ``None`` or a Noop and do nothing else, because its handler's leading guard sends ``event``
    straight to ``return None``. False whenever that is not certain."""
    if type(mod) is not types.FunctionType:
        return False
    key = (id(mod), type(event))
    reusable = key[1] in _SDK_EVENTS  # the answer depends on the event's class alone (turns_away_kind)
    entry = _READ.get(key[0])
    if reusable:
        decided = _DECIDED.get(key)
        if decided is not None and decided[0] is entry:
            return decided[1]
    if entry is None or entry[0]() is not mod or not _current(mod, entry):
        entry = _read(mod)
    away = _decide(mod, entry, event)
    if reusable:
        _DECIDED[key] = (entry, away)
    return away


def forget_decisions() -> None:
    """Code ran that may have changed what a guard reads (a mod call, an event listener), or a new
    step begins: every guard is read and resolved afresh. Until then a decision is reused for
    every event of its class: a step asks the same few mods about the same event classes once per
    request, and between two such questions no code of a mod or a listener ran. (Code on a thread
    of its own, a mod call abandoned after its time limit or a caller's, rebinds a name at no
    moment the engine can see; a new step resolves it afresh.)"""
    _DECIDED.clear()
    _ALL_DECIDED.clear()


_SDK_EVENTS = frozenset({Prefilled, ForwardPass, Sampled, Added})
# (id(mod), event class) -> (the mod's reading in _READ that decided, the decision), since
# forget_decisions; only for the SDK's own event classes (their instances' class is their type)
_DECIDED: dict[tuple[int, type], tuple[tuple[Any, ...], bool]] = {}
# (the mods, an event class or a tuple of them) -> turns_away_all's answer, since forget_decisions
# or a mod's new reading
_ALL_DECIDED: dict[tuple[tuple[Any, ...], type | tuple[type, ...]], bool] = {}


def _decide(mod: types.FunctionType, entry: tuple[Any, ...], event: Any) -> bool:
    """:func:`turns_away` with ``mod``'s current reading ``entry``: its guard run on ``event``."""
    handler, program = entry[2] or mod, entry[-1]
    if program is None:
        return False
    namespace, built = handler.__globals__, getattr(handler, "__builtins__", None)  # a function's own: no code runs
    if type(namespace) is not dict or type(built) is not dict \
            or namespace.get("isinstance", built.get("isinstance")) is not builtins.isinstance:
        return False
    position, tests = 0, 0
    while tests <= _MAX_TESTS:
        op = program[position]
        if op[0] == "none":
            return True
        if op[0] != "test":
            return False
        classes = _resolve_classes(handler, namespace, built, op[1])
        if classes is None:
            return False
        position = op[3] if isinstance(event, classes) is op[2] else op[4]
        tests += 1
    return False


def turns_away_kind(mod: Callable[..., Any], kind: type) -> bool:
    """:func:`turns_away` for every event of class ``kind`` at once, before one is made. A guard
    tests the event only with ``isinstance`` against plain classes, whose answer depends on the
    event's class alone, so a bare instance of ``kind`` (no fields; never handed to a mod) stands
    for them all."""
    if type(kind) is not type:  # a metaclass of its own could answer isinstance differently per instance
        return False
    bare = _BARE.get(kind)
    if bare is None:
        bare = _BARE[kind] = object.__new__(kind)
    return turns_away(mod, bare)


_BARE: dict[type, Any] = {}  # event class -> its bare instance (the SDK's four classes: a handful of entries)


def turns_away_all(mods: Sequence[Callable[..., Any]], kind: type | tuple[type, ...]) -> bool:
    """:func:`turns_away_kind` for every mod of ``mods`` and (a tuple) every class of ``kind``.
    Every request has a list of its own, most often of the same mods: the answer for a list of
    those mods is reused, as each mod's is, until :func:`forget_decisions` (or until a mod is read
    afresh), so that a step of 64 requests asks once, not 64 times (a request whose Sampled and
    Added nobody hears asks it of both at once)."""
    for m in mods:
        if type(m) is not types.FunctionType:  # (its hash or == could run its code) never turned away
            return False
    key = (tuple(mods), kind)  # plain functions and classes: hashed and compared by identity
    decided = _ALL_DECIDED.get(key)
    if decided is None:
        kinds: tuple[type, ...] = kind if isinstance(kind, tuple) else (kind,)
        decided = _ALL_DECIDED[key] = all(turns_away_kind(m, k) for k in kinds for m in mods)
    return decided


# id(mod) -> (a weak reference to the mod, its code, the handler (an SDK wrapper's; None: the mod
# itself), what else the reading depends on (compared by identity), the handler's guard program
# or None); an entry goes when its mod does (mods loaded per request come and go)
_READ: dict[int, tuple[Any, ...]] = {}


def _current(mod: types.FunctionType, entry: tuple[Any, ...]) -> bool:
    """Whether ``entry`` still reads ``mod``: its code, defaults and (an SDK wrapper's) cells, and
    its handler's code and defaults, are the same objects."""
    if mod.__code__ is not entry[1]:
        return False
    depends = entry[3]
    if depends[0] is None:  # a plain mod: its own defaults
        return mod.__defaults__ is depends[1] and mod.__kwdefaults__ is depends[2]
    try:
        for cell, value in zip(mod.__closure__ or (), depends[0]):
            if cell.cell_contents is not value:
                return False
    except ValueError:  # a cell emptied
        return False
    handler = entry[2]
    if type(handler) is not types.FunctionType:  # nothing was read of it: the cells say it all
        return True
    return handler.__code__ is depends[1] and handler.__defaults__ is depends[2] \
        and handler.__kwdefaults__ is depends[3]


def _read(mod: types.FunctionType) -> tuple[Any, ...]:
    """Read ``mod`` (see :data:`_READ`): the plain function its call runs first with the event as
    the first argument, and that function's guard; program None when there is none to follow or
    the call would not bind."""
    code = mod.__code__
    sdk = (_SDK or _sdk_wrappers()).get(id(code))
    handler: Any = mod
    arity = 2  # the manager calls a plain mod as mod(event, tokenizer)
    depends: tuple[Any, ...] = (None, mod.__defaults__, mod.__kwdefaults__)
    if sdk is not None and sdk[0] is code:
        try:
            contents = tuple(cell.cell_contents for cell in mod.__closure__ or ())
        except ValueError:  # an empty cell: not a wrapper the SDK made
            contents = ()
        _, handler_at, flags_at = sdk
        if len(contents) != len(code.co_freevars):
            handler, arity = None, 0
        elif flags_at is None:  # create_mod's: always three
            handler, arity = contents[handler_at], 3
        else:
            handler = contents[handler_at]
            arity = 3 if contents[flags_at[0]] else 2 if contents[flags_at[1]] else 0
        plain = type(handler) is types.FunctionType  # nothing else is read (an object's attributes may run code)
        depends = (contents, handler.__code__ if plain else None, handler.__defaults__ if plain else None,
                   handler.__kwdefaults__ if plain else None)
    program = None
    if type(handler) is types.FunctionType and not handler.__code__.co_flags & _NOT_PLAIN \
            and arity and _binds(handler, arity):
        program = _program(handler.__code__)
    key = id(mod)
    kept = None if handler is mod else handler  # the mod itself is held weakly, never by its own entry
    entry = _READ[key] = (weakref.ref(mod, _forget(key)), code, kept, depends, program)
    _ALL_DECIDED.clear()  # a decision for a list of mods rests on each mod's reading
    return entry


def _forget(key: int) -> Callable[[Any], None]:
    # the tables are bound here: a mod that lives until the interpreter exits is forgotten after
    # this module's names are gone
    read, decided, kinds = _READ, _DECIDED, _SDK_EVENTS

    def forget(_: Any) -> None:
        read.pop(key, None)
        for kind in kinds:  # its decisions hold what was read of it (an SDK wrapper's handler)
            decided.pop((key, kind), None)
    return forget


# id of an SDK wrapper's code object (every wrapper shares its function's code) -> the code, where
# its handler's cell is, and where its arity flags' are (ids: a code object hashes its whole content)
_SDK: dict[int, tuple[types.CodeType, int, tuple[int, int] | None]] = {}


def _sdk_wrappers() -> dict[int, tuple[types.CodeType, int, tuple[int, int] | None]]:
    from .decorator import create_mod, mod as sdk_mod

    def probe(event: Any, actions: Any, tokenizer: Any) -> None:
        return None

    wrapper, created = sdk_mod(probe).__code__, create_mod(probe).__code__  # type: ignore[attr-defined]
    names, created_names = wrapper.co_freevars, created.co_freevars
    _SDK[id(wrapper)] = (wrapper, names.index("handler"), (names.index("takes_three"), names.index("takes_two")))
    _SDK[id(created)] = (created, created_names.index("handler"), None)
    return _SDK


def _binds(fn: types.FunctionType, positional: int) -> bool:
    """Whether ``fn`` accepts exactly ``positional`` positional arguments and no more is required."""
    code = fn.__code__
    if code.co_argcount == 0:
        return False  # the event would not be a named parameter
    defaults = len(fn.__defaults__ or ())
    takes = code.co_argcount >= positional or bool(code.co_flags & inspect.CO_VARARGS)
    required_keywords = set(code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount])
    required_keywords -= set(fn.__kwdefaults__ or ())
    return takes and code.co_argcount - defaults <= positional and not required_keywords


def _resolve_classes(fn: types.FunctionType, namespace: dict[str, Any], built: dict[str, Any],
                     refs: tuple[_Ref, ...]) -> type | tuple[type, ...] | None:
    """What ``refs`` name now, as the handler's own instructions would load them (one class, or a
    tuple of them); None if any is not a plain class or cannot be read without running code."""
    classes = []
    for ref in refs:
        kind = ref[0]
        if kind == "global":
            value = namespace[ref[1]] if ref[1] in namespace else built.get(ref[1], _UNBOUND)
        elif kind == "deref":  # ("deref", name, its index among the code's free variables, or -1)
            value = _UNBOUND
            if ref[2] >= 0 and fn.__closure__ is not None:
                try:
                    value = fn.__closure__[ref[2]].cell_contents
                except ValueError:  # an empty cell
                    pass
        else:
            module = namespace[ref[1]] if ref[1] in namespace else built.get(ref[1])
            value = vars(module).get(ref[2], _UNBOUND) if type(module) is types.ModuleType else _UNBOUND
        if type(value) is not type:  # unbound, not a class, or a metaclass with its own instance check
            return None
        if len(refs) == 1:
            return value
        classes.append(value)
    return tuple(classes)


_UNBOUND = object()


def _program(code: types.CodeType) -> tuple[_Op, ...] | None:
    """The guard program of ``code`` (cached per code object), or None when it starts with no
    ``isinstance`` test of its first parameter."""
    entry = _PROGRAMS.get(id(code))
    if entry is not None and entry[0] is code:
        return entry[1]
    program = _read_guard(code)
    if len(_PROGRAMS) >= 4096:
        _PROGRAMS.clear()
    _PROGRAMS[id(code)] = (code, program)
    return program


def _read_guard(code: types.CodeType) -> tuple[_Op, ...] | None:
    every = list(dis.get_instructions(code))
    instructions = [i for i in every if i.opname not in _INERT]
    if not instructions or code.co_argcount == 0:
        return None
    index_of: dict[int, int] = {}
    following = len(instructions)
    kept = {ins.offset: k for k, ins in enumerate(instructions)}
    for ins in reversed(every):  # a jump to an inert instruction lands on the next one kept
        following = kept.get(ins.offset, following)
        index_of[ins.offset] = following
    ops = [_op_at(instructions, position, code, index_of) for position in range(len(instructions))]
    ops.append(_OTHER)  # past the end
    return tuple(ops) if ops[0][0] == "test" else None


def _op_at(ins: list[dis.Instruction], k: int, code: types.CodeType, index_of: dict[int, int]) -> _Op:
    first = ins[k]
    if first.opname == "RETURN_CONST" and first.argval is None:
        return ("none",)
    if first.opname == "LOAD_CONST" and first.argval is None and k + 1 < len(ins) \
            and ins[k + 1].opname == "RETURN_VALUE":
        return ("none",)
    # isinstance(event, refs): LOAD_GLOBAL isinstance, LOAD_FAST event, the refs, [BUILD_TUPLE n],
    # [PRECALL 2], CALL 2, [TO_BOOL], POP_JUMP_IF_FALSE/TRUE target
    if first.opname != "LOAD_GLOBAL" or first.argval != "isinstance":
        return _OTHER
    if k + 1 >= len(ins) or ins[k + 1].opname != "LOAD_FAST" or ins[k + 1].argval != code.co_varnames[0]:
        return _OTHER
    j, refs = k + 2, []
    while j < len(ins):
        ref, j = _ref_at(ins, j, code)
        if ref is None:
            break
        refs.append(ref)
    if not refs:
        return _OTHER
    if len(refs) > 1:
        if j >= len(ins) or ins[j].opname != "BUILD_TUPLE" or ins[j].arg != len(refs):
            return _OTHER
        j += 1
    if j < len(ins) and ins[j].opname == "PRECALL":
        if ins[j].arg != 2:
            return _OTHER
        j += 1
    if j >= len(ins) or ins[j].opname != "CALL" or ins[j].arg != 2:
        return _OTHER
    j += 1
    if j < len(ins) and ins[j].opname == "TO_BOOL":
        j += 1
    if j >= len(ins) or not isinstance(ins[j].argval, int):
        return _OTHER
    if ins[j].opname in _IF_FALSE:
        jump_if = False
    elif ins[j].opname in _IF_TRUE:
        jump_if = True
    else:
        return _OTHER
    target = index_of.get(ins[j].argval)
    if target is None:
        return _OTHER
    return ("test", tuple(refs), jump_if, target, j + 1)  # the last: where it goes on when it does not jump


def _ref_at(ins: list[dis.Instruction], j: int, code: types.CodeType) -> tuple[_Ref | None, int]:
    """A class reference at ``j`` and the position after it, or (None, j)."""
    here = ins[j]
    if here.opname == "LOAD_GLOBAL" and here.argrepr == here.argval:  # a value, no NULL pushed
        after = ins[j + 1] if j + 1 < len(ins) else None
        if after is not None and after.opname == "LOAD_ATTR" and after.argrepr == after.argval:
            return ("attr", here.argval, after.argval), j + 2
        return ("global", here.argval), j + 1
    if here.opname == "LOAD_DEREF":  # a free variable (a cell of the function's own is empty at its start)
        frees = code.co_freevars
        return ("deref", here.argval, frees.index(here.argval) if here.argval in frees else -1), j + 1
    return None, j
