"""The broad, licensed, offline corpus the embedded model's SAE is trained on — built from Debian packages.

Users prompt the embedded model with ordinary chat, so its SAE must reconstruct everyday English,
chat-template turns and some code alike; an SAE fitted to one technical corpus reconstructs
everyday text poorly. Every source here is a Debian package fetched by name with
``apt-get download`` (no install, no dependencies: the ``.deb`` is unpacked with ``dpkg-deb -x``)
into a git-ignored cache, so a fresh machine rebuilds exactly the same text from the package names
and versions recorded in the training report. A package that cannot be fetched or unpacked raises
:class:`CorpusSourceError` naming it and the command to fix it.

Three kinds of text, each held out separately so the report can say how the SAE does on each:

``prose``   fiction (Jane Austen's six novels; literature, humour and wisdom fortunes), encyclopaedic
            entries (FOLDOC, the Jargon File, The Devil's Dictionary, WordNet glosses), news-like
            clippings (fortune's ``news`` file) and instructions (Debian Reference, The Debian
            Administrator's Handbook) and, in the default ``broad-manuals`` corpus, GNU manuals
            (coreutils, Bash, find, sed, diff, Wget, grep: the Texinfo manuals as installed for
            ``info``).
``chat``    conversations in the model's own chat template — system prompt (default or custom),
            user turns (questions, requests, quotes) and assistant turns — whose answers are
            passages from the prose and code pools (disjoint from the passages used as plain text).
``code``    the Python 3.11 documentation sources (kept as one part, as before), Python standard
            library source code, and the Linux man-pages (sections 2, 4, 5, 7) as plain text.

Text the model would generate itself was left out: generating token by token runs at ~35 tok/s
batched on this CPU, so it could only ever be a negligible share; the chat kind covers the
template and assistant turns instead.

Everything is seeded: chunk order, source interleaving, question choice, conversation shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from random import Random
from typing import Any, Callable, Iterator

from .corpus_readers import (_FORTUNE_FILES, _read_austen, _read_dictd, _read_fortunes, _read_html, _read_info,
                             _read_jargon, _read_man, _read_pydoc_topics, _read_python_code, _read_python_docs,
                             _read_wordnet)
from engine.errors import ConfigError

from .debian_packages import CorpusSourceError, fetch_package

__all__ = ["Source", "SOURCES", "MANUAL_SOURCES", "KIND_SHARES", "CORPORA", "Corpus", "CorpusBuild", "build_corpus",
           "DEFAULT_CACHE", "DEFAULT_CORPUS"]

DEFAULT_CACHE = Path(__file__).resolve().parents[2] / "artifacts" / "sae-corpus"
KINDS = ("prose", "chat", "code")
#: Share of the collected tokens per kind of text (the broad corpus).
KIND_SHARES = {"prose": 0.45, "chat": 0.35, "code": 0.20}


@dataclass(frozen=True)
class Source:
    """One corpus part: which package ships it, under which licence, and how to read it."""

    name: str
    kind: str  # "prose" or "code": where its plain-text passages go (chat borrows from both)
    genre: str
    package: str
    licence: str
    weight: float  # share within its kind
    reader: Callable[[Path], list[str]] = field(repr=False, compare=False)


#: The broad corpus. ``weight`` is the source's share of its kind's plain-text tokens.
SOURCES: tuple[Source, ...] = (
    Source("austen", "prose", "fiction", "r-cran-janeaustenr",
           "novels public domain; package MIT (Julia Silge)", 0.26, _read_austen),
    Source("fortunes", "prose", "fiction", "fortunes", "BSD (fortune-mod); quotations", 0.06,
           _read_fortunes(_FORTUNE_FILES["fiction"])),
    Source("fortunes-min", "prose", "fiction", "fortunes-min", "BSD (fortune-mod); quotations", 0.03,
           _read_fortunes(("fortunes", "literature", "riddles"))),
    Source("foldoc", "prose", "encyclopaedic", "dict-foldoc", "GFDL-1.1+", 0.12, _read_dictd("foldoc")),
    Source("jargon", "prose", "encyclopaedic", "jargon-text", "public domain", 0.08, _read_jargon),
    Source("devils-dictionary", "prose", "encyclopaedic", "dict-devil", "public domain", 0.04,
           _read_dictd("devil")),
    Source("wordnet", "prose", "encyclopaedic", "wordnet-base", "WordNet 3.0 licence (BSD-like)", 0.06,
           _read_wordnet),
    Source("fortunes-news", "prose", "news-like", "fortunes", "BSD (fortune-mod); news clippings", 0.05,
           _read_fortunes(_FORTUNE_FILES["news"])),
    Source("debian-reference", "prose", "instructions", "debian-reference-en", "GPL-2+", 0.12,
           _read_html("usr/share/debian-reference", "*.en.html")),
    Source("debian-handbook", "prose", "instructions", "debian-handbook", "GPL-2+ or CC-BY-SA-3.0", 0.18,
           _read_html("usr/share/doc/debian-handbook/html/en-US", "*.html")),
    Source("python-docs", "code", "documentation", "python3.11-doc", "PSF-2.0", 0.40, _read_python_docs),
    Source("python-stdlib", "code", "code", "libpython3.11-stdlib", "PSF-2.0", 0.40, _read_python_code),
    Source("man-pages", "code", "documentation", "manpages", "Linux-man-pages-copyleft, GPL-2+, BSD, Expat "
           "(per page)", 0.20, _read_man),
)

#: GNU manuals (Texinfo, as installed for `info`): plain technical English about the tools users ask
#: about; ``broad-manuals`` (the committed SAE's corpus) has them in its prose, ``broad`` does not.
MANUAL_SOURCES: tuple[Source, ...] = (
    Source("coreutils-manual", "prose", "manuals", "coreutils", "GFDL-1.3+ (the manual; FSF)", 0.06,
           _read_info("coreutils")),
    Source("bash-manual", "prose", "manuals", "bash-doc", "GFDL-1.3+ (the manual; FSF)", 0.05, _read_info("bash")),
    Source("find-manual", "prose", "manuals", "findutils", "GFDL-1.3+ (the manual; FSF)", 0.03, _read_info("find")),
    Source("sed-manual", "prose", "manuals", "sed", "GFDL-1.3+ (the manual; FSF)", 0.02, _read_info("sed")),
    Source("diffutils-manual", "prose", "manuals", "diffutils", "GFDL-1.3+ (the manual; FSF)", 0.02,
           _read_info("diffutils")),
    Source("wget-manual", "prose", "manuals", "wget", "GFDL-1.3+ (the manual; FSF)", 0.02, _read_info("wget")),
    Source("grep-manual", "prose", "manuals", "grep", "GFDL-1.3+ (the manual; FSF)", 0.01, _read_info("grep")),
)

#: ``broad-manuals``: the broad corpus with the GNU manuals in its prose, so the SAE explains the
#: technical English users paste (the committed SAE's corpus). Prose weights make room for the
#: manuals (a fifth of the prose); kinds 50/32/18.
_MANUALS_PROSE_WEIGHTS = {"austen": 0.19, "fortunes": 0.05, "fortunes-min": 0.03, "foldoc": 0.10, "jargon": 0.07,
                          "devils-dictionary": 0.04, "wordnet": 0.05, "fortunes-news": 0.03, "debian-reference": 0.10,
                          "debian-handbook": 0.13}
_MANUALS_CORPUS_SOURCES = (tuple(replace(s, weight=_MANUALS_PROSE_WEIGHTS[s.name]) for s in SOURCES if s.kind == "prose")
                           + MANUAL_SOURCES + tuple(s for s in SOURCES if s.kind != "prose"))


#: A tiny corpus that needs no package (CPython's own ``pydoc_data``): for smoke tests.
CPYTHON_SOURCES: tuple[Source, ...] = (
    Source("pydoc-topics", "code", "documentation", "", "PSF-2.0", 1.0, _read_pydoc_topics),
)


@dataclass(frozen=True)
class Corpus:
    """A named mix: its sources (in the order the seeded interleaving draws them), the share of
    each kind of text, and whether chat turns are built from its passages."""

    sources: tuple[Source, ...]
    shares: dict[str, float]
    chat: bool = True


#: ``raylens train-sae --corpus NAME``. ``broad-manuals`` is the committed SAE's corpus, ``broad``
#: the one before it (4096 features): changing their sources, weights or order changes the text
#: they rebuild.
CORPORA: dict[str, Corpus] = {
    "broad": Corpus(SOURCES, KIND_SHARES),
    "broad-manuals": Corpus(_MANUALS_CORPUS_SOURCES, {"prose": 0.50, "chat": 0.32, "code": 0.18}),
    "cpython": Corpus(CPYTHON_SOURCES, {"code": 1.0}, chat=False),
}
#: The committed SAE's corpus: what ``raylens train-sae`` builds unless told otherwise.
DEFAULT_CORPUS = "broad-manuals"


# ------------------------------------------------------------------------------------- chat

_SYSTEM_PROMPTS = (None, None, None, "You are a helpful assistant.", "You are a concise, friendly assistant.",
                   "You are an expert who explains things clearly.", "Answer the user's questions carefully.")
_QUESTIONS = {
    "fiction": ("Tell me a story.", "Can you write a passage in the style of a classic novel?",
                "Continue the story, please.", "What happens next?", "Write a scene with some dialogue.",
                "Share something witty.", "Give me a quote to think about.", "Tell me something funny."),
    "encyclopaedic": ("What is {topic}?", "Can you explain {topic}?", "Define {topic}.",
                      "What does {topic} mean?", "Tell me about {topic}.", "I keep hearing about {topic}. What is it?"),
    "news-like": ("What's in the news today?", "Tell me an odd news story.", "Any interesting stories lately?",
                  "Summarise a news item for me."),
    "manuals": ("How do I use {topic}?", "What does the manual say about {topic}?", "Explain {topic} to me.",
                "Which option should I use for this?", "How does this command behave?"),
    "instructions": ("How do I do this on Debian?", "Can you walk me through it step by step?",
                     "How does this work on a Linux system?", "What should I know before I set this up?",
                     "Explain how to configure this.", "I'm new to Linux. Where do I start?"),
    "documentation": ("What does the documentation say about this?", "Explain this part of the docs.",
                      "Summarise this section for me.", "How do I use this?", "What does this function do?"),
    "code": ("Show me some example Python code.", "Can you write the code for this?",
             "How would this look in Python?", "Give me an implementation.", "Write a Python function for it."),
}
_FOLLOW_UPS = ("Thanks! Can you tell me more?", "Interesting. Go on.", "Can you give another example?",
               "Why is that?", "Ok, and then?", "That helps, thank you. One more thing?")


def _topic(chunk: str) -> str:
    first = chunk.split("\n", 1)[0].strip()
    words = first.split()
    return " ".join(words[:4]).rstrip(".,:;") if words else "this"


def _conversation(rng: Random, answers: list[tuple[Source, str]]) -> list[dict[str, str]]:
    system = rng.choice(_SYSTEM_PROMPTS)
    messages = [{"role": "system", "content": system}] if system else []
    for turn, (source, answer) in enumerate(answers):
        if turn:
            question = rng.choice(_FOLLOW_UPS)
        else:
            question = rng.choice(_QUESTIONS[source.genre]).format(topic=_topic(answer))
        if source.genre == "code":
            answer = f"Here is an example:\n\n```python\n{answer}\n```"
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


# ------------------------------------------------------------------------------------ build


@dataclass
class CorpusBuild:
    """Token sequences of one corpus, in kind order, with what each source contributed."""

    sequences: list[list[int]]
    kinds: list[str]  # per sequence
    source_tokens: dict[str, dict[str, int]]  # source -> kind -> tokens
    versions: dict[str, str]  # package -> Debian version
    sources: tuple[Source, ...]
    shares: dict[str, float]  # kind -> share asked for

    def manifest(self) -> dict[str, Any]:
        """The corpus mix and each source's licence, for the training report."""
        kind_tokens = {k: sum(1 for kind in self.kinds if kind == k) for k in KINDS}
        seq_len = len(self.sequences[0]) if self.sequences else 0
        return {
            "kinds": {k: {"sequences": n, "tokens": n * seq_len, "share": round(self.shares.get(k, 0.0), 3)}
                      for k, n in kind_tokens.items() if n},
            "sources": [
                {"name": s.name, "genre": s.genre, "package": s.package or "(ships with CPython)",
                 "version": self.versions.get(s.package, ""), "licence": s.licence,
                 "tokens": self.source_tokens.get(s.name, {})}
                for s in self.sources
            ],
            "chat": "conversations in the model's chat template (default or custom system prompt, 1-3 user/"
                    "assistant turns); user turns from fixed question templates, assistant turns are "
                    "passages of the sources above (not used as plain text)",
            "generated_text": "none (token-by-token generation is too slow on CPU; prefill-only collection)",
        }


def _load(sources: tuple[Source, ...], cache: Path) -> tuple[dict[str, list[str]], dict[str, str]]:
    texts, versions = {}, {}
    for source in sources:
        if source.package:
            root, versions[source.package] = fetch_package(source.package, cache)
        else:
            root = cache
        chunks = source.reader(root)
        if not chunks:
            raise CorpusSourceError(f"the corpus source {source.name!r} ({source.package}) gave no text",
                                    parameter="source", value=source.name)
        texts[source.name] = chunks
    return texts, versions


def build_corpus(tokenizer: Any, n_sequences: int, seq_len: int, *, seed: int = 0, corpus: str = DEFAULT_CORPUS,
                 cache: Path = DEFAULT_CACHE) -> CorpusBuild:
    """``n_sequences`` token sequences of ``seq_len`` from the corpus named ``corpus`` (:data:`CORPORA`),
    split over the kinds by its shares.

    Deterministic for a seed and the same package versions: every source's passages are shuffled
    with the seed, each source's passages are split between plain text and chat answers, and
    sources are interleaved by weight until each kind has its share of sequences.
    """
    if corpus not in CORPORA:
        raise ConfigError(f"unknown corpus {corpus!r}; choose one of {', '.join(CORPORA)}", parameter="corpus",
                          value=corpus)
    mix = CORPORA[corpus]
    sources = mix.sources
    texts, versions = _load(sources, cache)
    rng = Random(seed)
    kinds_present = sorted({s.kind for s in sources} | ({"chat"} if mix.chat else set()), key=KINDS.index)
    shares = {k: mix.shares[k] for k in kinds_present}
    total = sum(shares.values())
    quota = {k: int(n_sequences * shares[k] / total) for k in kinds_present}
    quota[kinds_present[0]] += n_sequences - sum(quota.values())

    plain: dict[str, list[str]] = {}
    chat_pool: dict[str, list[str]] = {}
    for source in sources:
        chunks = list(texts[source.name])
        Random(f"{seed}:{source.name}").shuffle(chunks)
        cut = len(chunks) // 3 if "chat" in quota else 0  # a third of every source answers chat turns
        chat_pool[source.name], plain[source.name] = chunks[:cut], chunks[cut:]

    source_tokens: dict[str, dict[str, int]] = {}
    sequences: list[list[int]] = []
    kinds: list[str] = []

    def fill(kind: str, documents: Iterator[tuple[list[Source], str]]) -> None:
        stream: list[tuple[int, str]] = []  # (token, source) pairs
        made = 0
        for used, text in documents:
            ids = tokenizer.encode(text, add_special_tokens=False)
            per = len(ids) // len(used)
            for i, token in enumerate(ids):
                stream.append((token, used[min(i // max(per, 1), len(used) - 1)].name))
            while len(stream) >= seq_len and made < quota[kind]:
                for _, name in stream[:seq_len]:
                    counts = source_tokens.setdefault(name, {})
                    counts[kind] = counts.get(kind, 0) + 1
                sequences.append([t for t, _ in stream[:seq_len]])
                kinds.append(kind)
                del stream[:seq_len]
                made += 1
            if made == quota[kind]:
                return
        raise CorpusSourceError(f"the corpus has too little {kind} text for {quota[kind]} sequences of {seq_len} "
                                f"tokens (got {made}); ask for fewer tokens", parameter="tokens", value=n_sequences)

    def weighted(pools: dict[str, list[str]], members: list[Source]) -> Iterator[Source]:
        cursor = {s.name: 0 for s in members}
        while True:
            live = [s for s in members if cursor[s.name] < len(pools[s.name])]
            if not live:
                return
            source = rng.choices(live, weights=[s.weight for s in live])[0]
            yield source
            cursor[source.name] += 1

    def take(pools: dict[str, list[str]], members: list[Source]) -> Iterator[tuple[Source, str]]:
        position = {s.name: 0 for s in members}
        for source in weighted(pools, members):
            text = pools[source.name][position[source.name]]
            position[source.name] += 1
            yield source, text

    for kind in kinds_present:
        if kind == "chat":
            continue
        members = [s for s in sources if s.kind == kind]
        separator = "\n\n"
        fill(kind, (([s], text + separator) for s, text in take(plain, members)))
    if "chat" in quota:
        members = list(sources)
        answers = take(chat_pool, members)

        def conversations() -> Iterator[tuple[list[Source], str]]:
            while True:
                turns = []
                for _ in range(rng.choice((1, 1, 2, 3))):
                    item = next(answers, None)
                    if item is None:
                        break
                    turns.append(item)
                if not turns:
                    return
                text = tokenizer.apply_chat_template(_conversation(rng, turns), tokenize=False)
                yield [s for s, _ in turns], text

        fill("chat", conversations())
    order = {k: i for i, k in enumerate(KINDS)}
    ranked = sorted(range(len(sequences)), key=lambda i: order[kinds[i]])  # stable: kind order
    return CorpusBuild([sequences[i] for i in ranked], [kinds[i] for i in ranked], source_tokens, versions, sources,
                       mix.shares)
