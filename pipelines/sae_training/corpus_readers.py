"""Each corpus source's files as text passages of about ``_CHUNK_CHARS`` characters.

One reader per file format the sources ship: R lazy-load data (Jane Austen's novels), fortune
files, dictd databases, the Jargon File, WordNet glosses, HTML manuals, GNU Info manuals,
reStructuredText, Python source and roff man pages. A reader takes the unpacked package's root and returns its passages;
prose is cut at paragraph boundaries, code at blank lines with its indentation kept.
"""

from __future__ import annotations

import gzip
import html
import re
import struct
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Callable

from .debian_packages import CorpusSourceError, _need

_CHUNK_CHARS = 1200


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
        self.data, self.pos = data, 2
        self.refs: list[Any] = []
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
            symbol = self.read()
            self.refs.append(symbol)
            return symbol
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            text = self.data[self.pos:self.pos + n].decode("utf-8", "replace")
            self.pos += n
            return text
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


#: Info nodes that are not the manual's own prose: the title page (copyright), the licence
#: appendix and the indexes.
_INFO_SKIP_NODES = ("Top", "GNU Free Documentation License", "Copying This Manual", "Copying", "Index")


def _info_prose(node: str) -> str:
    """One Info node as text: its ``File: ..., Node: ...`` line, heading underlines and menus dropped."""
    lines = node.splitlines()[1:]  # the node's header line
    kept, in_menu = [], False
    for line in lines:
        if line.startswith("* Menu:"):
            in_menu = True
        elif in_menu and line.strip() and not line.startswith(("* ", " ")):
            in_menu = False
        if not in_menu and not (line.strip() and set(line.strip()) <= set("*=-.")):
            kept.append(line)
    return "\n".join(kept)


def _read_info(*names: str) -> Callable[[Path], list[str]]:
    """GNU Texinfo manuals as installed (``usr/share/info/<name>.info[-N].gz``), node by node."""
    def read(root: Path) -> list[str]:
        chunks = []
        for name in names:
            files = sorted(_need(root, "usr/share/info").glob(f"{name}.info*.gz"))
            if not files:
                raise CorpusSourceError(f"{root.name} has no Info manual {name!r}: the package layout changed",
                                        parameter="package", value=root.name)
            for path in files:
                for node in gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace").split("\x1f")[1:]:
                    header = node.lstrip("\n").split("\n", 1)[0]
                    title = header.partition("Node: ")[2].split(",")[0].strip()
                    if not header.startswith("File:") or title.endswith(_INFO_SKIP_NODES):
                        continue  # tag tables, indirect tables, the licence and the indexes
                    chunks.extend(_paragraph_chunks(_info_prose(node.lstrip("\n"))))
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
