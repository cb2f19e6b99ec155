
var FOLD = 24; // prompt tokens a Generation view shows before its "show the whole prompt" switch

// Keep `node` visible inside the scrolling `box` (without scrolling the page itself).
function keepVisible(box, node) {
  if (!node) return;
  var top = node.offsetTop - box.offsetTop, bottom = top + node.offsetHeight;
  if (top < box.scrollTop) box.scrollTop = top;
  else if (bottom > box.scrollTop + box.clientHeight) box.scrollTop = bottom - box.clientHeight;
}

// The words of a path as prose from token `first` on, into `box`: one span per token, or one per run of tokens that
// make a character together; `decorate(span, steps)` styles a span whose tokens are the targets of those steps.
function proseWords(box, path, groupOf, first, offset, decorate) {
  for (var t = first; t < path.tokens.length;) {
    var g = groupOf[t], last = g ? g[1] : t, own = [];
    for (var u = t; u <= last; u++) if (u - offset >= 0 && u - offset < path.steps.length) own.push(u - offset);
    var span = el("span", { className: "w" + (!g && SPECIAL[path.tokens[t]] ? " special" : ""), text: g ? g[3] : proseOf(path.tokens[t]) });
    if (own.length) decorate(span, own); else span.classList.add("context");
    box.appendChild(span);
    t = last + 1;
  }
}

// What a path view's parts share: the path, where its steps' targets sit among its tokens, the pinned step and page,
// whether the prompt is unfolded, and the view's own hover and select (set by pathView).
function pathContext(path) {
  var isTrace = path.kind === "trace";
  return { path: path, steps: path.steps, isTrace: isTrace, offset: isTrace ? 1 : path.prompt_length,
    groupOf: groupIndex(path), positions: path.positions || DATA.positions,
    state: { page: 0, selected: 0, unfold: false }, hover: null, select: null, refold: null,
    stepOf: function (t) { var i = t - this.offset; return i >= 0 && i < this.steps.length ? i : null; } };
}
function hoverable(P, node, i) {
  node.addEventListener("mouseenter", function () { node.classList.add("hovered"); P.hover(i); });
  node.addEventListener("mouseleave", function () { node.classList.remove("hovered"); P.hover(P.state.selected); });
  node.addEventListener("click", function () { P.select(i); });
}

// The text as prose coloured by rank (a Generation view folds its prompt to the last FOLD tokens).
function proseView(P) {
  var box = el("div", { className: "prose", lang: "und" }), spans = {};
  function draw() {
    box.textContent = "";
    spans = {};
    var first = 0, n = P.path.prompt_length;
    if (!P.isTrace && n > FOLD) {
      var fold = el("button", { type: "button", className: "fold", text: P.state.unfold ? "\u25be fold the prompt"
        : "\u25b8 " + (n - FOLD) + " earlier prompt tokens" });
      fold.addEventListener("click", function () { P.state.unfold = !P.state.unfold; P.refold(); });
      box.appendChild(fold);
      if (!P.state.unfold) first = n - FOLD;
    }
    proseWords(box, P.path, P.groupOf, first, P.offset, function (span, own) {
      var worst = own.reduce(function (a, b) { return P.steps[b].rank > P.steps[a].rank ? b : a; });
      span.dataset.step = worst;
      span.title = "step " + worst + " \u00b7 rank " + P.steps[worst].rank;
      if (own.some(function (i) { return !P.steps[i].real; })) span.classList.add("shared");
      own.forEach(function (i) { spans[i] = span; });
      hoverable(P, span, worst);
    });
    repaint();
  }
  function repaint() { Object.keys(spans).forEach(function (i) { paint(spans[i], P.steps[+spans[i].dataset.step].rank); }); }
  function mark(i) { if (spans[i]) { spans[i].classList.add("selected"); keepVisible(box, spans[i]); } }
  draw();
  return { box: box, draw: draw, repaint: repaint, mark: mark };
}

// One box per step, the tokens of a character grouped under it; the start or the prompt's last tokens before them.
function chipFor(P, t, chips) {
  var i = P.stepOf(t), id = P.path.tokens[t];
  if (i === null) return el("span", { className: "step prompt", title: "node " + id + (P.isTrace ? " (the start)" : " (prompt)") },
    [el("span", { className: "tok", text: lab(id) })]);
  var st = P.steps[i];
  var c = el("span", { className: "step" + (st.real ? "" : " shared"), data: { step: i },
    title: "step " + i + ": " + lab(st.src) + " \u2192 " + lab(st.tgt) + " \u00b7 rank " + st.rank + (st.real ? "" : " \u00b7 shared edge") },
    [el("span", { className: "tok", text: lab(st.tgt) }), el("span", { className: "e", text: fmt(st.e) })]);
  paint(c, st.rank);
  hoverable(P, c, i);
  chips[i] = c;
  return c;
}
function fillStrip(P, strip, lo, hi, chips) {
  var t = lo > 0 ? lo + P.offset : P.isTrace || P.state.unfold ? 0 : Math.max(0, P.path.prompt_length - 3), end = hi + P.offset;
  if (lo === 0 && !P.isTrace && t > 0) {
    var fold = el("span", { className: "step prompt fold", text: "\u2026 " + t + " prompt tokens", title: "show the whole prompt" });
    fold.addEventListener("click", function () { P.state.unfold = true; P.refold(); });
    strip.appendChild(fold);
  }
  while (t < end) {
    var g = P.groupOf[t];
    if (!g) { strip.appendChild(chipFor(P, t, chips)); t++; continue; }
    var last = Math.min(g[1], end - 1), pieces = el("span", { className: "pieces" });
    for (var u = t; u <= last; u++) pieces.appendChild(chipFor(P, u, chips));
    strip.appendChild(el("span", { className: "group", title: "tokens " + g[0] + "\u2013" + g[1] + " make " + g[2] },
      [el("span", { className: "char", text: g[2] }), pieces]));
    t = last + 1;
  }
}

// The steps, PAGE to a page, with the pager: "prev" / "next" move the pinned step onto the page they show.
function stripView(P) {
  var steps = P.steps, pages = Math.ceil(steps.length / PAGE), chips = {};
  var prev = el("button", { type: "button", className: "prev", text: "\u2039 prev" });
  var next = el("button", { type: "button", className: "next", text: "next \u203a" });
  var where = el("span", { className: "where" }), strip = el("div", { className: "strip" });
  var go = el("input", { type: "number", min: "0", max: String(steps.length - 1), className: "goto", placeholder: "step" });
  function turn(p) { P.select(Math.max(0, Math.min(pages - 1, p)) * PAGE); }
  prev.addEventListener("click", function () { turn(P.state.page - 1); });
  next.addEventListener("click", function () { turn(P.state.page + 1); });
  go.addEventListener("change", function () { var i = parseInt(go.value, 10); if (i >= 0 && i < steps.length) P.select(i); });
  var pager = el("div", { className: "pager" }, [prev, where, next, el("label", { text: "go to step " }, [go]),
    el("span", { className: "hint", text: "\u2190 / \u2192 step" })]);
  function setPage(p) {
    P.state.page = Math.max(0, Math.min(pages - 1, p));
    strip.textContent = "";
    chips = {};
    var lo = P.state.page * PAGE, hi = Math.min(steps.length, lo + PAGE);
    fillStrip(P, strip, lo, hi, chips);
    where.textContent = "steps " + lo + "\u2013" + (hi - 1) + " of " + steps.length + " (page " + (P.state.page + 1) + "/" + pages + ")";
    prev.disabled = P.state.page === 0; next.disabled = P.state.page === pages - 1;
  }
  return { pager: pager, box: strip, setPage: setPage,
    shows: function (i) { return strip.firstChild !== null && Math.floor(i / PAGE) === P.state.page; },
    mark: function (i) { if (chips[i]) { chips[i].classList.add("selected"); keepVisible(strip, chips[i]); } },
    repaint: function () { Object.keys(chips).forEach(function (i) { paint(chips[i], steps[i].rank); }); } };
}

// A path's view: the text as prose coloured by rank, the energy chart, the steps (paged), one step's details.
function pathView(path, root, name) {
  var P = pathContext(path), steps = path.steps;
  root.appendChild(summaryLine(path));
  root.appendChild(legend(P.isTrace));
  if (!steps.length) { root.appendChild(el("p", { className: "hint", text: "no steps (nothing was generated)." })); return null; }
  var layout = el("div", { className: "layout" }), left = el("div"), details = el("div", { className: "details" });
  function render(i) {
    details.textContent = "";
    details.dataset.step = i;
    details.appendChild(stepDetails(path, steps[i], i, P.groupOf[i + P.offset], P.positions));
  }
  function select(i) {
    P.state.selected = i;
    if (!strip.shows(i)) strip.setPage(Math.floor(i / PAGE));
    Array.prototype.forEach.call(root.querySelectorAll(".selected"), function (c) { c.classList.remove("selected"); });
    strip.mark(i); prose.mark(i); chart.mark(i);
    render(i);
  }
  P.hover = render; P.select = select;
  P.refold = function () { prose.draw(); strip.setPage(P.state.page); select(P.state.selected); };
  var prose = proseView(P), strip = stripView(P), chart = energyChart([{ steps: steps }], select);
  root.appendChild(el("div", { className: "prose-box" }, [el("h4", { text: P.isTrace ? "the text" : "the continuation" }), prose.box]));
  [chart.svg, strip.pager, strip.box].forEach(function (n) { left.appendChild(n); });
  layout.appendChild(left); layout.appendChild(details); root.appendChild(layout);
  repainters.push(function () { strip.repaint(); prose.repaint(); chart.repaint(); });
  stepper[name] = function (delta) { select(Math.max(0, Math.min(steps.length - 1, P.state.selected + delta))); };
  select(worstStep(steps));
  return { select: select };
}

function summaryLine(path) {
  var s = path.summary, n = path.steps.length;
  return el("div", { className: "summary", text: (path.name ? path.name + ": " : "") + (path.kind === "trace"
    ? n + " steps \u00b7 perplexity " + fmt(s.perplexity) + " \u00b7 top-1 " + pct(s.top1_accuracy) +
      " \u00b7 mean rank " + fmt(s.mean_rank, 2)
    : "prompt of " + path.prompt_length + " token(s), " + n + " generated") });
}

function legend(isTrace) {
  return el("div", { className: "legend hint" }, [
    el("span", { className: "step r1", text: "rank 1" }), el("span", { className: "step r2", text: "rank 2\u201310" }),
    el("span", { className: "step r3", text: "rank > 10" }), el("span", { className: "step shared", text: "shared edge" }),
    el("span", { className: "scale", title: "the continuous scale: green at rank 1 to red at rank V, by log rank" }),
    isTrace ? "each box: the true next token and the energy its edge delivers; hover or click a step"
      : "each box: the chosen token and its energy; hover or click a step"]);
}

// One step's details: the nodes, energy, rank, probability, the model's pick, the edge, the character it helps make,
// the strongest alternatives and the signal's mix.
function stepDetails(path, st, i, group, positions) {
  var isTrace = path.kind === "trace", box = el("div");
  box.appendChild(el("h3", {}, ["Step " + i + ": ", tok(st.src), " \u2192 ", tok(st.tgt),
    group ? el("span", { className: "hint", text: "  part of " + group[2] }) : null]));
  var table = el("table", { className: "facts" });
  table.appendChild(row("signal sits on", "source", nodeLink(st.src)));
  table.appendChild(row(isTrace ? "true next token" : "chosen token", "target", nodeLink(st.tgt)));
  if (group) {
    table.appendChild(row("character", "character", group[2] + "  (tokens " + group[0] + "\u2013" + group[1] + " together)"));
    table.appendChild(row("this token's bytes", "bytes", (DATA.bytes || {})[String(st.tgt)] || lab(st.tgt)));
  }
  table.appendChild(row("energy", "energy", fmt(st.e)));
  table.appendChild(row("rank", "rank", st.rank + " of " + M.vocab_size));
  table.appendChild(row(isTrace ? "probability" : "probability (decoding)", "probability", fmt(st.p, 4)));
  if (isTrace) table.appendChild(row("model's pick", "predicted", st.rank === 1 ? "the true next token"
    : lab(st.pred) + " (" + fmt(st.pe) + ")"));
  table.appendChild(row("edge", "edge", st.real ? "real edge of the graph" : "the shared edge (no real edge)"));
  box.appendChild(table);
  box.appendChild(el("h4", { text: isTrace ? "strongest alternatives" : "runner-ups" }));
  box.appendChild(alternatives(st, isTrace));
  box.appendChild(el("h4", { text: "signal mix x" + sub(st.i) + " over the edges crossed so far" }));
  box.appendChild(mixList(path.tokens, st.i, positions));
  return box;
}

function alternatives(st, isTrace) {
  var ctx = st.ctx || null, top = st.e;
  st.alts.forEach(function (a) { if (a[1] !== null) top = Math.max(top, a[1]); });
  var table = el("table", { className: "alts" }, [head(["token", "energy", ""].concat(ctx ? ["in context"] : []))]);
  function add(content, energy, cls, id) {
    var cells = [el("td", {}, [content]), el("td", { className: "num e", text: fmt(energy) }),
      el("td", { className: "barcell" }, [bar(energy === null ? 0 : energy, top || 1)])];
    if (ctx) cells.push(el("td", { className: "ctx", text: ctx[String(id)] || "" }));
    var r = el("tr", { className: cls }, cells);
    if (cls === "alt") r.dataset.token = id;
    table.appendChild(r);
  }
  add(el("span", { className: "tok", text: lab(st.tgt) + (isTrace ? " (true)" : " (chosen)") }), st.e, "target", st.tgt);
  st.alts.forEach(function (a) { add(nodeLink(a[0]), a[1], "alt", a[0]); });
  return table;
}

// The strongest contributions to the signal at position i (the edge entering token k carries weight w_k).
function mixList(tokens, i, positions) {
  var box = el("div", { className: "mix" });
  if (i === 0) { box.appendChild(el("p", { className: "hint", text: "the start signal e\u2080: no edge crossed yet" })); return box; }
  var w = mixWeights(positions, i), order = w.map(function (_, k) { return k; });
  order.sort(function (a, b) { return w[b] - w[a] || b - a; });
  var table = el("table", { className: "mixtable" });
  order.slice(0, 8).forEach(function (k) {
    var position = k + 1;
    var edge = el("td", {}, [tok(tokens[position - 1]), " \u2192 ", tok(tokens[position])]);
    table.appendChild(el("tr", { data: { position: position, weight: w[k] } }, [el("td", { className: "num", text: "pos " + position }), edge,
      el("td", { className: "num w", text: pct(w[k]) }), el("td", { className: "barcell" }, [bar(w[k], w[order[0]])])]));
  });
  box.appendChild(table);
  box.appendChild(el("p", { className: "hint", text: i + " edge(s) in the mix" + (i > 8 ? ", the 8 strongest shown" : "") +
    "; the latest edge weighs " + pct(w[i - 1]) + " (softmax of the position weights)" }));
  return box;
}
