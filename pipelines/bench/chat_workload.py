"""A chat workload for routing: conversations that share long system prompts, turn after turn.

Each of ``systems`` system prompts (about ``system_tokens`` tokens of rules, different from their
first words on, so no two share a cache block) opens ``chats_per_system`` conversations; every
conversation asks ``turns`` questions, each turn's prompt holding the whole conversation so far
(the model's earlier answers included). Deterministic for a seed: the e2e test and the bench run the
same requests under every policy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Chat", "system_prompt", "chats", "interleaved"]

_NAMES = ("Atlas", "Bramble", "Cobalt", "Dunmore", "Ember", "Fennel", "Garnet", "Hollis")
_TOPICS = ("opening hours", "late returns", "the reading room", "printing", "children's events", "lost cards",
           "inter-library loans", "quiet study", "donations", "parking", "accessibility", "group visits")
_VERBS = ("explain", "confirm", "summarise", "list", "describe", "clarify")


def system_prompt(index: int, words: int = 450) -> str:
    """System prompt ``index``: an assistant's name and ``words`` words of numbered rules (about
    1.3 tokens a word for SmolLM2's tokenizer, so 450 words are about 600 tokens)."""
    rng = random.Random(1000 + index)
    name = _NAMES[index % len(_NAMES)]
    lines = [f"You are {name}, the help desk assistant of the {name} public library."]
    count = len(lines[0].split())
    rule = 1
    while count < words:
        line = (f"Rule {rule}: when asked about {rng.choice(_TOPICS)}, {rng.choice(_VERBS)} the policy in one "
                f"sentence, then {rng.choice(_VERBS)} what the visitor should do next.")
        lines.append(line)
        count += len(line.split())
        rule += 1
    return "\n".join(lines)


@dataclass
class Chat:
    """One conversation: its system prompt's index and its user turns; ``messages`` grows as the
    answers come (:meth:`answer`)."""

    system: int
    questions: list[str]
    messages: list[dict[str, str]] = field(default_factory=list)

    def prompt(self, turn: int, system_text: str) -> list[dict[str, str]]:
        """The messages of turn ``turn`` (the answers to the earlier turns must be in)."""
        if not self.messages:
            self.messages = [{"role": "system", "content": system_text}]
        return self.messages + [{"role": "user", "content": self.questions[turn]}]

    def answer(self, turn: int, text: str) -> None:
        self.messages += [{"role": "user", "content": self.questions[turn]}, {"role": "assistant", "content": text}]


def chats(systems: int, chats_per_system: int, turns: int, *, seed: int = 0) -> list[Chat]:
    """The conversations, system by system (``interleaved`` orders them for a run)."""
    rng = random.Random(seed)
    out = []
    for s in range(systems):
        for c in range(chats_per_system):
            questions = [f"Question {t + 1} from visitor {s}-{c}: could you {rng.choice(_VERBS)} "
                         f"{rng.choice(_TOPICS)} for me?" for t in range(turns)]
            out.append(Chat(s, questions))
    return out


def interleaved(conversations: list[Chat], run: int = 2) -> list[Chat]:
    """Conversations in the order ``run`` of each system, then ``run`` of the next, and so on
    (``run=2`` with two systems: A A B B A A …), so that taking turns puts every system prompt on
    every replica while affinity can keep each on one."""
    by_system: dict[int, list[Chat]] = {}
    for chat in conversations:
        by_system.setdefault(chat.system, []).append(chat)
    queues = [list(v) for _, v in sorted(by_system.items())]
    out = []
    while any(queues):
        for queue in queues:
            out += queue[:run]
            del queue[:run]
    return out
