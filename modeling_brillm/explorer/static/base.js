// BriLLM explorer: renders the JSON that modeling_brillm/explorer embeds in the page. Every token text goes into
// the page as text (textContent), never as markup.
var DATA = JSON.parse(document.getElementById("brillm-data").textContent);
var PAGE = 200; // steps per page: a 2,000-token text stays quick to draw
var SVGNS = "http://www.w3.org/2000/svg";
var app = document.getElementById("app");
var M = DATA.model || {};
var SPECIAL = {};
(DATA.specials || []).forEach(function (id) { SPECIAL[id] = true; });
var settings = { colour: "buckets" }; // or "continuous": a colour scale over log rank
var repainters = []; // each view's function that recolours it when the colour setting changes

function el(tag, props, children) {
  var node = document.createElement(tag);
  props = props || {};
  Object.keys(props).forEach(function (key) {
    if (key === "text") node.textContent = props[key];
    else if (key === "className") node.className = props[key];
    else if (key === "data") Object.keys(props.data).forEach(function (d) { node.dataset[d] = props.data[d]; });
    else if (key === "style") node.style.cssText = props[key];
    else node.setAttribute(key, props[key]);
  });
  (children || []).forEach(function (child) {
    if (child !== null && child !== undefined) node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
  });
  return node;
}
function svg(tag, attrs, text) {
  var node = document.createElementNS(SVGNS, tag);
  Object.keys(attrs || {}).forEach(function (key) { node.setAttribute(key, attrs[key]); });
  if (text !== undefined) node.textContent = text;
  return node;
}
function fmt(x, digits) { return x === null || x === undefined ? "\u2013" : x.toFixed(digits === undefined ? 3 : digits); }
function pct(x) { return (100 * x).toFixed(1) + "%"; }
function lab(id) { var t = DATA.labels[String(id)]; return t === undefined ? "#" + id : t; }
function proseOf(id) { var t = (DATA.prose || {})[String(id)]; return t === undefined ? lab(id) : t; }
function sub(i) { return String(i).split("").map(function (c) { return String.fromCharCode(0x2080 + +c); }).join(""); }

// Rank colours: three buckets (1, 2-10, worse), or a continuous scale from green (rank 1) to red (rank V) over
// log rank, so rank 2 and rank 3,000 no longer share a colour.
function rankClass(rank) { return rank === 1 ? "r1" : rank <= 10 ? "r2" : "r3"; }
function rankShade(rank) {
  var t = Math.log(Math.max(1, rank)) / Math.log(Math.max(2, M.vocab_size || 2));
  return "hsl(" + Math.round(130 * (1 - t)) + ", 70%, " + Math.round(84 - 6 * t) + "%)";
}
function bucketShade(rank) { return rank === 1 ? "#d9f2df" : rank <= 10 ? "#fff1c9" : "#fbdada"; }
function pointShade(rank) { return rank === 1 ? "#2e9d4f" : rank <= 10 ? "#d29b12" : "#d0423a"; }
function paint(node, rank) {
  node.classList.remove("r1", "r2", "r3");
  node.classList.add(rankClass(rank));
  node.style.backgroundColor = settings.colour === "continuous" ? rankShade(rank) : "";
}
function setColour(mode) {
  settings.colour = mode;
  document.body.dataset.colour = mode;
  repainters.forEach(function (f) { f(); });
}

var views = {}, tabs = {}, active = null, stepper = {};
function show(name) {
  Object.keys(views).forEach(function (v) {
    views[v].hidden = v !== name;
    tabs[v].classList.toggle("active", v === name);
  });
  active = name;
}
function tok(id, cls) { return el("span", { className: "tok" + (cls ? " " + cls : ""), text: lab(id), title: "node " + id }); }
// Every token is a link to its node: the Node view shows its edges, or says how to add them to the page.
function nodeLink(id) {
  if (DATA.diff) return tok(id); // a diff page holds no Node view
  var a = el("a", { className: "node tok", text: lab(id), title: "node " + id + ": its edges", href: "#",
    data: { node: id } });
  a.addEventListener("click", function (ev) { ev.preventDefault(); openNode(id); });
  return a;
}
var openNode = function () {}; // set by the Node view
function row(name, field, content) {
  var cell = el("td", { data: { field: field } }, content instanceof Node ? [content] : []);
  if (!(content instanceof Node)) cell.textContent = content;
  return el("tr", {}, [el("th", { text: name }), cell]);
}
function bar(value, max) { return el("div", { className: "bar", style: "width:" + Math.max(2, 100 * value / max) + "%" }); }
function head(names) {
  return el("thead", {}, [el("tr", {}, names.map(function (n) { return el("th", { text: n }); }))]);
}
// The step where the true (or chosen) token ranks worst: where the page opens.
function worstStep(steps) {
  var best = 0;
  steps.forEach(function (s, i) { if (s.rank > steps[best].rank) best = i; });
  return best;
}

// The weights of the signal's mix at position i: softmax over the weight logits of the edges entering tokens 1..i
// (past the trained positions every edge uses the last logit, as the model does).
function mixWeights(positions, i) {
  var P = positions, n = P.length, logits = [], top = -Infinity, sum = 0, k;
  for (k = 1; k <= i; k++) { logits.push(P[Math.min(k - 1, n - 1)]); top = Math.max(top, logits[k - 1]); }
  var w = logits.map(function (p) { var e = Math.exp(p - top); sum += e; return e; });
  return w.map(function (e) { return e / sum; });
}

// The characters a path's tokens make together: for token index t, the group [first, last, label, prose] that
// holds it (several tokens whose bytes make whole characters only together), or null.
function groupIndex(path) {
  var of = new Array(path.tokens.length).fill(null);
  (path.groups || []).forEach(function (g) { for (var t = g[0]; t <= g[1]; t++) of[t] = g; });
  return of;
}
