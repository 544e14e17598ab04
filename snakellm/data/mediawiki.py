"""MediaWiki XML dumps (Wikipedia ``pages-articles*.xml.bz2``) as a source: one document per article.

The NeMo GPT-2 recipe starts from ``enwiki-latest-pages-articles.xml.bz2`` and a
separate WikiExtractor run; here a dump file is simply a shard of a
``format: mediawiki`` source. The XML is streamed (``iterparse`` over the
decompressed stream, each page freed once read), so a 20 GB dump never sits in
memory; a multistream dump is a series of bz2 streams, which the reader follows
to the end like a plain one. The encoding is whatever the XML declaration says
(dumps are UTF-8; anything expat decodes works).

Only articles become documents: pages outside namespace 0 (talk, user, file,
category, template ... pages) and redirects are skipped and counted. The text
is cleaned with mwparserfromhell: templates, tables, references, comments,
galleries, math and similar tags, file/image and category links and
interlanguage links are dropped; links keep their label, bold/italic and
headings their text. Namespace names come from the dump's own ``<siteinfo>``,
so ``[[Kategorie:...]]`` or ``[[Fichier:...]]`` in other languages are removed too.
"""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass

import mwparserfromhell
from mwparserfromhell.definitions import is_visible
from mwparserfromhell.nodes import ExternalLink, Heading, HTMLEntity, Tag, Text, Wikilink

from snakellm.io.readers import DamagedShardError, display, open_shard

# Tags whose content is not running text (or is rendered from data, like tables).
DROP_TAGS = frozenset(
    {
        "ref", "references", "gallery", "table", "math", "chem", "ce", "timeline", "imagemap", "score",
        "syntaxhighlight", "source", "graph", "mapframe", "maplink", "templatedata", "templatestyles", "inputbox",
        "hiero", "categorytree", "noinclude",
    }
)  # fmt: skip
# Always dropped, whatever the dump's language: the canonical names and common aliases.
DROP_LINK_NAMESPACES = frozenset({"file", "image", "media", "category"})
_INTERWIKI = re.compile(r"^:?[a-z]{2,3}(-[a-z]+)*:", re.I)
_EMPTY_PARENS = re.compile(r"\(\s*[,;:]?\s*\)|\[\s*\]")
_SPACE_BEFORE_PUNCT = re.compile(r"[ \t]+([,.;:!?)])")
_BLANKS = re.compile(r"\n{3,}")
# Removed before parsing: references and comments are never text, and malformed markup
# inside them (an unclosed '' in a citation) would otherwise make the parser keep them as text.
_PRE = re.compile(r"<!--.*?(?:-->|$)|<ref\b[^>]*?/>|<ref\b[^>]*>.*?(?:</ref\s*>|$)", re.S | re.I)
# What malformed markup can leave behind after parsing: stray tags and quote runs.
_LEFTOVER_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]*(?:\s[^<>]*)?/?>")
_QUOTES = re.compile(r"'{2,}")
_SPACES = re.compile(r"[ \t\u00a0]{2,}")


@dataclass
class Page:
    number: int  # 1-based position in the dump (the "line" of a rejected record)
    title: str
    id: str
    ns: int
    wikitext: str
    text: str = ""
    skip: str = ""  # "redirect", "namespace": not an article
    bytes_in: int = 0


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _strip(code, drop: frozenset[str]) -> str:
    """mwparserfromhell's ``strip_code`` semantics, dropping the unwanted nodes while walking.

    (Removing them from the tree first costs more than parsing: every removal searches it.)
    """
    out: list[str] = []
    for node in code.nodes:
        if isinstance(node, Text):
            out.append(node.value)
        elif isinstance(node, Wikilink):
            target = str(node.title).strip()
            prefix, colon, _ = target.lstrip(":").partition(":")
            if colon and not target.startswith(":") and (prefix.strip().lower() in drop or _INTERWIKI.match(target)):
                continue  # an image, a category, a link to another language's article
            out.append(_strip(node.text if node.text is not None else node.title, drop))
        elif isinstance(node, Tag):
            name = str(node.tag).strip().lower()
            if name in DROP_TAGS or not is_visible(name):
                continue
            if node.contents is not None:
                out.append(_strip(node.contents, drop))
        elif isinstance(node, Heading):
            out.append(_strip(node.title, drop).strip())
        elif isinstance(node, ExternalLink):
            if not node.brackets:
                out.append(str(node.url))
            elif node.title is not None:
                out.append(_strip(node.title, drop))
        elif isinstance(node, HTMLEntity):
            out.append(node.normalize())
        # templates, comments, template arguments: nothing
    return "".join(out)


def _drop_tables(wikitext: str) -> str:
    """Remove ``{| ... |}`` tables line by line (nesting counted): a malformed table
    (an unbalanced quote in a style) would otherwise reach the text as markup."""
    if "{|" not in wikitext:
        return wikitext
    out: list[str] = []
    depth = 0
    for line in wikitext.splitlines(keepends=True):
        stripped = line.lstrip(" :\t")
        if stripped.startswith("{|"):
            depth += 1
        elif depth and stripped.startswith("|}"):
            depth -= 1
            tail = stripped[2:]
            if not depth and tail.strip():
                out.append(tail)
        elif not depth:
            out.append(line)
    return "".join(out)


def _drop_links(wikitext: str, names: frozenset[str]) -> str:
    """Remove ``[[File:...]]``-style links (nested links in captions included, brackets balanced)."""
    pat = re.compile(r"\[\[\s*(?:" + "|".join(map(re.escape, sorted(names))) + r")\s*:", re.I)
    out: list[str] = []
    pos = 0
    while m := pat.search(wikitext, pos):
        out.append(wikitext[pos : m.start()])
        depth, i = 1, m.end()
        while depth and i < len(wikitext):
            if wikitext.startswith("[[", i):
                depth, i = depth + 1, i + 2
            elif wikitext.startswith("]]", i):
                depth, i = depth - 1, i + 2
            else:
                nxt = min(
                    (j for j in (wikitext.find("[[", i), wikitext.find("]]", i)) if j >= 0), default=len(wikitext)
                )
                i = nxt
        pos = i
    out.append(wikitext[pos:])
    return "".join(out)


def clean_wikitext(wikitext: str, drop_namespaces: frozenset[str] = DROP_LINK_NAMESPACES) -> str:
    """The running text of an article's wikitext: markup, templates, tables and references removed."""
    text = _strip(
        mwparserfromhell.parse(_drop_links(_drop_tables(_PRE.sub("", wikitext)), drop_namespaces)), drop_namespaces
    )
    text = _QUOTES.sub("", _LEFTOVER_TAG.sub("", text))
    text = _EMPTY_PARENS.sub("", text)
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    text = _SPACES.sub(" ", text)
    lines = [ln.strip() for ln in text.split("\n")]
    # list bullets and table leftovers that stripped to punctuation alone carry no text
    lines = [ln for ln in lines if not ln or any(c.isalnum() for c in ln)]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


class _Metered:
    """The decompressed dump as iterparse reads it, failing when one page's XML grows past a cap.

    expat holds a page's text whole until its end tag: without a cap, one page
    of a damaged or hostile dump (a decompression bomb) could take all memory.
    """

    def __init__(self, path: str, fh, cap: int | None) -> None:
        self.path, self.fh, self.cap = path, fh, cap
        self.read_bytes = 0
        self.mark = 0  # read_bytes when the last page ended
        self.page = 1  # the number of the page being read

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.read_bytes += len(data)
        if self.cap is not None and self.read_bytes - self.mark > self.cap:
            raise DamagedShardError(
                f"{display(self.path)}: page {self.page} (or what follows page {self.page - 1}) is more than "
                f"{self.cap} bytes of XML, past the max_document_bytes limit"
            )
        return data


def iter_pages(
    path: str, compression: str | None = None, raw: io.RawIOBase | None = None, max_page_bytes: int | None = None
) -> Iterator[Page]:
    """Every page of a dump, in order: articles with their cleaned ``text``, the rest with ``skip`` set.

    XML that does not parse fails naming the dump and the page after which it broke
    (expat's line and column alone name no file). A page whose XML passes
    twice ``max_page_bytes`` (plus 1 MiB for markup) fails the job rather than
    taking all memory.
    """
    ns_names: set[str] = set()
    drop = DROP_LINK_NAMESPACES
    number = 0
    cap = None if max_page_bytes is None else 2 * max_page_bytes + (1 << 20)
    with open_shard(path, "mediawiki", compression, raw) as fh:
        src = _Metered(path, fh, cap)
        context = ET.iterparse(src, events=("start", "end"))
        root = None
        try:
            for event, elem in context:
                if root is None:
                    root = elem
                    if _local(root.tag) != "mediawiki":
                        raise DamagedShardError(
                            f"{display(path)}: not a MediaWiki XML dump (root element <{_local(root.tag)}>)"
                        )
                    continue
                if event != "end":
                    continue
                name = _local(elem.tag)
                if name == "siteinfo":
                    for ns in elem.iter():
                        if _local(ns.tag) == "namespace" and ns.text and ns.get("key") in ("6", "14", "-2"):
                            ns_names.add(ns.text.strip().lower())
                    drop = DROP_LINK_NAMESPACES | frozenset(ns_names)
                    root.clear()
                elif name == "page":
                    number += 1
                    src.mark, src.page = src.read_bytes, number + 1
                    yield _page(elem, number, drop)
                    root.clear()  # keep memory flat: nothing of a page survives it
        except ET.ParseError as e:
            raise DamagedShardError(
                f"{display(path)}: damaged XML after page {number} ({src.read_bytes} bytes decompressed): {e}"
            ) from None


def _page(elem: ET.Element, number: int, drop: frozenset[str]) -> Page:
    title = page_id = ""
    ns = 0
    redirect = False
    wikitext = ""
    for child in elem:
        n = _local(child.tag)
        if n == "title":
            title = child.text or ""
        elif n == "ns":
            ns = int((child.text or "0").strip() or 0)
        elif n == "id":
            page_id = (child.text or "").strip()
        elif n == "redirect":
            redirect = True
        elif n == "revision":
            for r in child:
                if _local(r.tag) == "text":
                    wikitext = r.text or ""
    page = Page(number, title, page_id, ns, wikitext, bytes_in=len(wikitext.encode("utf-8")))
    if ns != 0:
        page.skip = "namespace"
    elif redirect or wikitext.lstrip()[:9].upper() == "#REDIRECT":
        page.skip = "redirect"
    else:
        page.text = clean_wikitext(wikitext, drop)
    return page
