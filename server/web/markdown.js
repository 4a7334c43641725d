// A small Markdown renderer for model output. Everything is escaped first; markup then only wraps escaped
// text in fixed tags, so no model output can become HTML of its own (no tags, no attributes, no URLs but
// http and https).

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const HOLE = "\u0000"; // marks a piece of finished HTML inside text still to be marked up

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const FENCE = /^ {0,3}(```+|~~~+)\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const LIST_ITEM = /^ {0,3}([-*+]|\d{1,9}[.)])\s+(.*)$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;

export function renderMarkdown(source) {
  const lines = source.replaceAll(HOLE, "").replace(/\r\n?/g, "\n").split("\n");
  const html = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i += 1;
    } else if (FENCE.test(line)) {
      i = codeBlock(lines, i, html);
    } else if (HEADING.test(line)) {
      const [, marks, text] = line.match(HEADING);
      html.push(`<h${marks.length}>${renderInline(text)}</h${marks.length}>`);
      i += 1;
    } else if (RULE.test(line)) {
      html.push("<hr>");
      i += 1;
    } else if (QUOTE.test(line)) {
      i = quote(lines, i, html);
    } else if (LIST_ITEM.test(line)) {
      i = list(lines, i, html);
    } else {
      i = paragraph(lines, i, html);
    }
  }
  return html.join("\n");
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || LIST_ITEM.test(line);
}

function codeBlock(lines, start, html) {
  const [, fence, language] = lines[start].match(FENCE);
  const body = [];
  let i = start + 1;
  // An unclosed fence runs to the end: while a reply streams in, its code block is still open.
  while (i < lines.length && !lines[i].trimStart().startsWith(fence)) body.push(lines[i++]);
  const attribute = language ? ` class="language-${escapeHtml(language)}"` : "";
  html.push(`<pre><code${attribute}>${escapeHtml(body.join("\n"))}</code></pre>`);
  return i + 1;
}

function quote(lines, start, html) {
  const body = [];
  let i = start;
  while (i < lines.length && QUOTE.test(lines[i])) body.push(lines[i++].match(QUOTE)[1]);
  html.push(`<blockquote>${renderMarkdown(body.join("\n"))}</blockquote>`);
  return i;
}

function list(lines, start, html) {
  const ordered = /\d/.test(lines[start].match(LIST_ITEM)[1]);
  const items = [];
  let i = start;
  while (i < lines.length) {
    const item = lines[i].match(LIST_ITEM);
    if (item && /\d/.test(item[1]) === ordered) {
      items.push([item[2]]);
    } else if (items.length && /^\s+\S/.test(lines[i]) && !startsBlock(lines[i])) {
      items[items.length - 1].push(lines[i].trim()); // an item's continuation line
    } else {
      break;
    }
    i += 1;
  }
  const tag = ordered ? "ol" : "ul";
  const first = ordered ? parseInt(lines[start].match(LIST_ITEM)[1], 10) : 1;
  const opening = ordered && first !== 1 ? `<ol start="${first}">` : `<${tag}>`;
  const body = items.map((item) => `<li>${item.map(renderInline).join("<br>")}</li>`).join("");
  html.push(`${opening}${body}</${tag}>`);
  return i;
}

function paragraph(lines, start, html) {
  const body = [lines[start]];
  let i = start + 1;
  while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) body.push(lines[i++]);
  // Chat replies mean their line breaks: keep them.
  html.push(`<p>${body.map((line) => renderInline(line.trim())).join("<br>")}</p>`);
  return i;
}

// Inline markup: code spans keep their text literal; links and emphasis apply to the escaped rest.
function renderInline(text) {
  const pieces = [];
  const hole = (piece) => `${HOLE}${pieces.push(piece) - 1}${HOLE}`;
  let marked = text.replace(/`([^`]+)`/g, (_, code) => hole(`<code>${escapeHtml(code)}</code>`));
  marked = escapeHtml(marked);
  marked = marked.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)\u0000]+)\)/g, (_, label, url) =>
    hole(`<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`),
  );
  marked = emphasis(marked);
  const filled = new RegExp(`${HOLE}(\\d+)${HOLE}`, "g");
  // Twice: a link's label may hold a code span's hole.
  return marked.replace(filled, (_, n) => pieces[n]).replace(filled, (_, n) => pieces[n]);
}

function emphasis(text) {
  return text
    .replace(/\*\*(?=\S)(.*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)(.*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)(.*?\S)~~/g, "<del>$1</del>");
}
