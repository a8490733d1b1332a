"""Where the text comes from: a built-in demo corpus, WikiText and plain text files, and a sentence
splitter.

Sentence splitting is rule-based on purpose. The original ALBERT collaborative recipe calls
``nltk.sent_tokenize``, which needs the ``punkt`` model downloaded at run time; volunteers' machines
may have no internet beyond PyPI, and a download in the middle of ``cotrain prepare`` is one more
thing to fail. Sentence-order prediction only needs boundaries that are right most of the time (a
missed boundary makes a longer sentence, which is harmless), so a few rules do: split after ``.``,
``!`` or ``?`` followed by whitespace and an uppercase letter, digit or quote, except after common
abbreviations, initials and WikiText's ``@.@`` number separators.
"""

from __future__ import annotations

import ast
import glob
import itertools
import logging
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from cotrain.data.errors import DataError

logger = logging.getLogger(__name__)

MIN_PARAGRAPH_CHARS = 40

# Stdlib modules whose docstrings extend the demo corpus. Their source is parsed, not imported, so
# the text cannot change with what else the process has imported or patched.
DEMO_DOC_MODULES = (
    "asyncio.events", "asyncio.locks", "asyncio.queues", "asyncio.streams", "asyncio.tasks", "base64",
    "bisect", "calendar", "concurrent.futures._base", "configparser", "contextlib", "copy", "csv",
    "decimal", "difflib", "email.message", "fractions", "ftplib", "functools", "gettext", "heapq", "hmac",
    "html.parser", "http.client", "http.cookiejar", "http.server", "imaplib", "inspect", "ipaddress",
    "json", "json.decoder", "logging", "logging.handlers", "multiprocessing.pool", "numbers",
    "optparse", "os", "pathlib", "pprint", "queue", "random", "sched", "secrets", "selectors", "shlex",
    "shutil", "smtplib", "socket", "statistics", "string", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "traceback", "typing", "unittest.case", "unittest.mock", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref",
)  # fmt: skip

_UNDERLINE = re.compile(r"\s*[*=\-~^#+_]{3,}\s*")
_BULLET = re.compile(r"(\*|-|•|\[\d+\]|\d+\.)\s+")
_WIKITEXT_HEADING = re.compile(r"=( =)* .*\S.* =( =)*")
_PROSE_END = re.compile(r"[.!?:][\"'”’)\]]*")
_LETTER = re.compile(r"[^\W\d_]")
_SYMBOL = re.compile(r"[^\w\s.,;:'\"()?!’‘“”-]|_")  # characters other than letters, digits, prose punctuation

ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt ft messrs vs cf ca approx fig figs vol vols ch no nos op pp ed eds "
    "al gen col lt capt sgt cmdr adm gov sen rep rev hon pres dept univ co corp bros inc ltd "
    "jan feb mar apr jun jul aug sep sept oct nov dec".split()
)
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*\s+")
_DOTTED_ABBREVIATION = re.compile(r"(?:[A-Za-z]\.){2,}")
_INITIAL = re.compile(r"[A-Z]\.")
_DETACHED_QUOTE = re.compile(r'"\s+')
_ALNUM = re.compile(r"[^\W_]")
_OPENING = "\"'“‘(["


def _normalize_space(text: str) -> str:
    return " ".join(text.split())


def _prose_paragraph(raw: str) -> str | None:
    """Turn one blank-line-separated block of documentation into a line of prose, or None if it is
    code, grammar, a heading or too short to be worth a document."""
    lines = [line.rstrip() for line in raw.splitlines() if line.strip() and not _UNDERLINE.fullmatch(line)]
    if not lines:
        return None
    stripped = [line.lstrip() for line in lines]
    if any(line.startswith((">>>", "...", "$ ")) for line in stripped):
        return None
    indents = [len(line) - len(line.lstrip()) for line in lines]
    bullet = _BULLET.match(stripped[0])
    if len(lines) > 1:
        if len(set(indents[1:])) > 1:  # nested indentation: a code block
            return None
        if indents[1] != indents[0] and not (bullet and indents[1] > indents[0]):
            return None
    if bullet:
        stripped[0] = stripped[0][bullet.end() :]
    text = _normalize_space(" ".join(stripped))
    if len(text) < MIN_PARAGRAPH_CHARS or "::=" in text or not _PROSE_END.search(text[-3:]):
        return None
    visible = len(text) - text.count(" ")
    letters = len(_LETTER.findall(text))
    symbols = len(_SYMBOL.findall(text))
    if letters < 0.7 * visible or symbols > 0.05 * visible:
        return None
    return text


def _module_docstrings(module_name: str) -> Iterator[str]:
    """The docstrings in a stdlib module's source: the module's, then those of its public classes,
    functions and methods in source order."""
    base = Path(sysconfig.get_paths()["stdlib"], *module_name.split("."))
    for source in (base.with_suffix(".py"), base / "__init__.py"):
        if source.is_file():
            break
    else:
        return
    try:
        tree = ast.parse(source.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return
    nodes: list[ast.AST] = [tree]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _public(node.name):
            nodes.append(node)
            if isinstance(node, ast.ClassDef):
                nodes.extend(
                    child
                    for child in node.body
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(child.name)
                )
    for node in nodes:
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        if doc:
            yield doc


def _public(name: str) -> bool:
    return not name.startswith("_")


def _demo_sources() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions package pydoc_data separately
        logger.warning("pydoc_data is not installed; the demo corpus uses module docstrings only")
    else:
        for key in sorted(topics):
            yield topics[key]
    for module_name in DEMO_DOC_MODULES:
        yield from _module_docstrings(module_name)


def demo_corpus() -> list[str]:
    """English documentation paragraphs that ship with CPython (pydoc help topics, then docstrings
    of a fixed list of stdlib modules): a corpus that needs no download. One document per prose
    paragraph, whitespace-normalized, deduplicated, in a deterministic order."""
    documents: list[str] = []
    seen: set[str] = set()
    for source in _demo_sources():
        for raw in re.split(r"\n\s*\n", source):
            text = _prose_paragraph(raw)
            if text is not None and text not in seen:
                seen.add(text)
                documents.append(text)
    return documents


def _check_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise DataError(f"text file not found: {path}")
    if not path.is_file():
        raise DataError(f"not a regular file: {path} (pass text files, or a glob such as 'dir/*.txt')")
    return path


def _lines(path: Path) -> Iterator[str]:
    try:
        with path.open(encoding="utf-8") as f:
            yield from f
    except UnicodeDecodeError as e:
        message = f"{path} is not UTF-8 text (undecodable byte at offset {e.start}); convert it first"
        raise DataError(message) from None


def _is_wikitext_heading(line: str) -> bool:
    return bool(_WIKITEXT_HEADING.fullmatch(line.strip()))


def _iter_wikitext(path: Path) -> Iterator[str]:
    for line in _lines(path):
        text = line.strip()
        if text and not _is_wikitext_heading(text):
            yield text


def wikitext_articles(path: str | Path) -> Iterator[str]:
    """A WikiText file's articles, each one line of its paragraphs joined (headings skipped): documents as
    long as whole articles rather than single paragraphs."""
    article: list[str] = []
    for line in _lines(_check_file(path)):
        text = line.strip()
        if _is_wikitext_heading(text):
            if not text.startswith("= ="):  # a top-level ``= Title =``: the next article starts
                if article:
                    yield " ".join(article)
                article = []
        elif text:
            article.append(text)
    if article:
        yield " ".join(article)


def _iter_plain(path: Path) -> Iterator[str]:
    paragraph: list[str] = []
    for line in _lines(path):
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield _normalize_space(" ".join(paragraph))
            paragraph = []
    if paragraph:
        yield _normalize_space(" ".join(paragraph))


def _looks_like_wikitext(path: Path, max_lines: int = 200) -> bool:
    lines = _lines(path)
    try:
        return any(_is_wikitext_heading(line) for line in itertools.islice(lines, max_lines))
    finally:
        lines.close()


def _nonempty(documents: Iterator[str], what: str) -> Iterator[str]:
    count = 0
    for document in documents:
        count += 1
        yield document
    if count == 0:
        raise DataError(f"no text in {what}: give files with at least one non-empty paragraph")


def read_wikitext(path: str | Path) -> Iterator[str]:
    """Paragraphs of a WikiText file (one paragraph per line, ``= Title =`` headings skipped),
    stripped. Raises DataError at once if the file is missing, later if it holds no text or is not
    UTF-8."""
    checked = _check_file(path)
    return _nonempty(_iter_wikitext(checked), str(checked))


def expand_paths(paths: list[str]) -> list[Path]:
    """Expand globs (sorted within each pattern) and check that every file exists."""
    files: list[Path] = []
    for pattern in paths:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise DataError(f"no file matches {pattern!r}")
            files.extend(_check_file(m) for m in matches)
        else:
            files.append(_check_file(pattern))
    if not files:
        raise DataError("no text files given")
    return files


def read_text_files(paths: list[str]) -> Iterator[str]:
    """Paragraphs of plain text files (separated by blank lines, whitespace-normalized); files that
    look like WikiText are read with :func:`read_wikitext`. Globs are expanded. Missing files raise
    DataError at once; undecodable bytes or no text at all raise it while iterating."""
    files = expand_paths(paths)

    def generate() -> Iterator[str]:
        for path in files:
            wikitext = _looks_like_wikitext(path)
            logger.debug("reading %s as %s", path, "WikiText" if wikitext else "plain text")
            yield from (_iter_wikitext(path) if wikitext else _iter_plain(path))

    return _nonempty(generate(), ", ".join(str(p) for p in files))


def _is_boundary(text: str, punct_start: int, next_start: int) -> bool:
    nxt = text[next_start]
    if not (nxt.isupper() or nxt.isdigit() or nxt in _OPENING or text.startswith("<unk>", next_start)):
        return False
    if text[punct_start] != "." or text.startswith(".", punct_start + 1):
        return True  # "!", "?" and ellipses always end a sentence
    if punct_start == 0 or text[punct_start - 1].isspace():
        return True  # a detached period, as in WikiText's "end . Next"
    if text[punct_start - 1] == "@":
        return False  # WikiText "1 @.@ 5"
    token = text[: punct_start + 1].rsplit(None, 1)[-1].lstrip(_OPENING)
    if _DOTTED_ABBREVIATION.fullmatch(token) or _INITIAL.fullmatch(token):
        return False
    return token[:-1].lower() not in ABBREVIATIONS


def split_sentences(text: str) -> list[str]:
    """Split text into sentences with the rules described in the module docstring. Whitespace in
    each sentence is normalized; every sentence has at least one letter or digit."""
    text = _normalize_space(text)
    sentences: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        end = match.end()
        if end < len(text) and text[end] == '"' and text.count('"', start, end) % 2 == 1:
            # a closing quote detached from the period (WikiText's `said . " Next`) ends this sentence
            after = _DETACHED_QUOTE.match(text, end)
            if after is None:
                continue
            end = after.end()
        if end < len(text) and _is_boundary(text, match.start(), end):
            sentences.append(text[start:end].strip())
            start = end
    if start < len(text):
        sentences.append(text[start:].strip())
    merged: list[str] = []
    for sentence in sentences:
        if merged and not _ALNUM.search(sentence):
            merged[-1] = f"{merged[-1]} {sentence}"
        elif sentence:
            merged.append(sentence)
    return merged
