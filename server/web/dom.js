// Small DOM helpers shared by the page's modules.

export function isScrolledToEnd() {
  const list = byId("messages");
  return list.scrollHeight - list.scrollTop - list.clientHeight < 40;
}

export function scrollToEnd() {
  const list = byId("messages");
  list.scrollTop = list.scrollHeight;
}

export function byId(id) {
  return document.getElementById(id);
}

export function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}
