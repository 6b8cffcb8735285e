"""One document, three renderings: terminal text, markdown and HTML.

The diagnosis and the compare report are built once as a list of blocks (headings, paragraphs,
bullet lists, tables, raw HTML for the timelines) and rendered by the functions here, so the
three outputs never disagree on a number.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field


@dataclass
class Heading:
    text: str
    level: int = 2
    anchor: str | None = None


@dataclass
class Para:
    text: str
    css: str | None = None  # "verdict", "change", "check", "note"


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    caption: str | None = None
    css: str | None = None
    align_left: int = 1  # the first N columns are text (left-aligned); the rest numbers


@dataclass
class RawHtml:
    """Only in the HTML rendering (timelines, images); `text` stands in for it elsewhere."""

    html: str
    text: str = ""


Block = Heading | Para | Bullets | Table | RawHtml


@dataclass
class Doc:
    title: str
    blocks: list[Block] = field(default_factory=list)

    def add(self, *blocks: Block) -> Doc:
        self.blocks.extend(blocks)
        return self


# -- text ------------------------------------------------------------------------------------------------
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def _plain(s: str) -> str:
    s = _LINK.sub(lambda m: f"{m.group(1)} ({m.group(2)})" if m.group(1) != m.group(2) else m.group(1), s)
    return re.sub(r"\*\*(.+?)\*\*|`(.+?)`", lambda m: m.group(1) or m.group(2), s)


def _wrap(text: str, width: int = 100, first: str = "", rest: str = "") -> str:
    import textwrap

    # a word longer than the line (a file path) is kept whole, so that it can be copied from the terminal
    return textwrap.fill(text, width=width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False,
                         break_long_words=False)


def table_text(t: Table) -> str:
    rows = [[_plain(c) for c in t.headers]] + [[_plain(c) for c in r] for r in t.rows]
    widths = [max(len(r[i]) if i < len(r) else 0 for r in rows) for i in range(len(t.headers))]
    out = []
    for n, r in enumerate(rows):
        cells = [(c.ljust(w) if i < t.align_left else c.rjust(w)) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  " + "  ".join(cells).rstrip())
        if n == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    if t.caption:
        out.insert(0, _wrap(_plain(t.caption), first="  ", rest="  "))
    return "\n".join(out)


def render_text(doc: Doc, width: int = 100) -> str:
    out = [doc.title, "=" * min(width, len(doc.title)), ""]
    for b in doc.blocks:
        if isinstance(b, Heading):
            out += [_plain(b.text), ("=" if b.level == 1 else "-") * min(width, len(_plain(b.text)))]
        elif isinstance(b, Para):
            prefix = {"change": "  change: ", "check": "  worked if: ", "note": "  note: "}.get(b.css or "", "")
            out.append(_wrap(prefix + _plain(b.text), width, rest="    " if prefix else ""))
        elif isinstance(b, Bullets):
            out += [_wrap(_plain(i), width, first="  - ", rest="    ") for i in b.items]
        elif isinstance(b, Table):
            out.append(table_text(b))
        elif isinstance(b, RawHtml):
            if b.text:
                out.append(_wrap(_plain(b.text), width))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


# -- markdown ---------------------------------------------------------------------------------------------
def _md_cell(s: str) -> str:
    return s.replace("|", "\\|")


def render_markdown(doc: Doc) -> str:
    out = [f"# {doc.title}", ""]
    for b in doc.blocks:
        if isinstance(b, Heading):
            out.append("#" * (b.level + 1 if b.level < 5 else 6) + " " + b.text)
        elif isinstance(b, Para):
            prefix = {"change": "**Change:** ", "check": "**Worked if:** ", "note": "_Note:_ "}.get(b.css or "", "")
            out.append(prefix + b.text)
        elif isinstance(b, Bullets):
            out += [f"- {i}" for i in b.items]
        elif isinstance(b, Table):
            if b.caption:
                out += [b.caption, ""]
            out.append("| " + " | ".join(_md_cell(h) for h in b.headers) + " |")
            out.append("|" + "|".join(":---" if i < b.align_left else "---:" for i in range(len(b.headers))) + "|")
            out += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in b.rows]
        elif isinstance(b, RawHtml):
            if b.text:
                out.append(b.text)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


# -- HTML -------------------------------------------------------------------------------------------------------
CSS = """
:root { --fg:#1d2330; --muted:#5b6577; --line:#d9dee7; --bg:#ffffff; --soft:#f4f6fa; --accent:#2f6fde; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
       background: var(--bg); margin: 0 auto; padding: 18px 28px 60px; max-width: 1400px; }
h1 { font-size: 22px; margin: 0 0 12px; } h2 { font-size: 18px; margin: 28px 0 8px;
  border-bottom: 1px solid var(--line); padding-bottom: 4px; } h3 { font-size: 15px; margin: 18px 0 6px; }
table { border-collapse: collapse; margin: 6px 0 14px; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid var(--line); padding: 3px 8px; text-align: right; vertical-align: top; }
th { background: var(--soft); font-weight: 600; } td.l, th.l { text-align: left; }
caption { caption-side: top; text-align: left; color: var(--muted); padding: 2px 0 4px; }
p.verdict { font-weight: 600; } p.change { border-left: 3px solid var(--accent); padding-left: 8px; }
p.check { border-left: 3px solid #2e9e5b; padding-left: 8px; } p.note { color: var(--muted); }
code { background: var(--soft); padding: 0 3px; border-radius: 3px; }
ul { margin: 4px 0 10px; padding-left: 22px; }
.rank1 td { background: #fff6e0; }
"""


def _inline(s: str) -> str:
    s = html.escape(s)
    s = _LINK.sub(lambda m: f'<a href="{m.group(2)}">{m.group(1)}</a>', s)
    s = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", s)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", s)


def table_html(t: Table) -> str:
    cls = f' class="{t.css}"' if t.css else ""
    out = [f"<table{cls}>"]
    if t.caption:
        out.append(f"<caption>{_inline(t.caption)}</caption>")
    out.append("<thead><tr>" + "".join(
        f'<th class="{"l" if i < t.align_left else "r"}">{_inline(h)}</th>' for i, h in enumerate(t.headers))
        + "</tr></thead><tbody>")
    for n, r in enumerate(t.rows):
        row_cls = ' class="rank1"' if (t.css == "ranking" and n == 0) else ""
        out.append(f"<tr{row_cls}>" + "".join(
            f'<td class="{"l" if i < t.align_left else "r"}">{_inline(c)}</td>' for i, c in enumerate(r)) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def render_html_body(doc: Doc) -> str:
    out = [f"<h1>{_inline(doc.title)}</h1>"]
    for b in doc.blocks:
        if isinstance(b, Heading):
            lvl = min(6, b.level)
            anchor = f' id="{html.escape(b.anchor)}"' if b.anchor else ""
            out.append(f"<h{lvl}{anchor}>{_inline(b.text)}</h{lvl}>")
        elif isinstance(b, Para):
            cls = f' class="{b.css}"' if b.css else ""
            prefix = {"change": "<strong>Change:</strong> ", "check": "<strong>Worked if:</strong> ",
                      "note": "Note: "}.get(b.css or "", "")
            out.append(f"<p{cls}>{prefix}{_inline(b.text)}</p>")
        elif isinstance(b, Bullets):
            out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, Table):
            out.append(table_html(b))
        elif isinstance(b, RawHtml):
            out.append(b.html)
    return "\n".join(out)


ERROR_TRAP = """<script>
window.__phaselabErrors = [];
window.addEventListener('error', function (e) {
  window.__phaselabErrors.push(String(e.message || e));
  var p = document.getElementById('js-errors');
  if (p) { p.textContent += 'JS error: ' + (e.message || e) + '\\n'; p.style.display = 'block'; }
});
</script>"""


def render_html(doc: Doc, extra_head: str = "") -> str:
    """A complete, self-contained page (no external resource). JavaScript errors are also
    written into <pre id="js-errors"> so a headless browser's DOM dump shows them."""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{html.escape(doc.title)}</title>"
        f"<style>{CSS}</style>{ERROR_TRAP}{extra_head}</head><body>\n"
        '<pre id="js-errors" style="display:none;color:#b00020"></pre>\n'
        f"{render_html_body(doc)}\n</body></html>\n"
    )
