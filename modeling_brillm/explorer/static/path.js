
var FOLD = 24; // prompt tokens a Generation view shows before its "show the whole prompt" switch

// Keep `node` visible inside the scrolling `box` (without scrolling the page itself).
function keepVisible(box, node) {
  if (!node) return;
  var top = node.offsetTop - box.offsetTop, bottom = top + node.offsetHeight;
  if (top < box.scrollTop) box.scrollTop = top;
  else if (bottom > box.scrollTop + box.clientHeight) box.scrollTop = bottom - box.clientHeight;
}

// A path's view: the text as prose coloured by rank, the energy chart, the steps as chips (paged), one step's details.
function pathView(path, root, name) {
  var steps = path.steps, isTrace = path.kind === "trace", s = path.summary;
  var offset = isTrace ? 1 : path.prompt_length; // step i's target is token i + offset
  var groupOf = groupIndex(path), positions = path.positions || DATA.positions;
  var state = { page: 0, selected: 0, unfold: false };
  root.appendChild(el("div", { className: "summary", text: (path.name ? path.name + ": " : "") + (isTrace
    ? steps.length + " steps \u00b7 perplexity " + fmt(s.perplexity) + " \u00b7 top-1 " + pct(s.top1_accuracy) +
      " \u00b7 mean rank " + fmt(s.mean_rank, 2)
    : "prompt of " + path.prompt_length + " token(s), " + steps.length + " generated") }));
  root.appendChild(legend(isTrace));
  if (!steps.length) { root.appendChild(el("p", { className: "hint", text: "no steps (nothing was generated)." })); return null; }
  var prose = el("div", { className: "prose", lang: "und" });
  root.appendChild(el("div", { className: "prose-box" }, [el("h4", { text: isTrace ? "the text" : "the continuation" }), prose]));
  var layout = el("div", { className: "layout" }), left = el("div"), details = el("div", { className: "details" });
  layout.appendChild(left); layout.appendChild(details); root.appendChild(layout);
  var chart = energyChart([{ steps: steps }], function (i) { select(i); });
  left.appendChild(chart.svg);
  var pages = Math.ceil(steps.length / PAGE);
  var prev = el("button", { type: "button", className: "prev", text: "\u2039 prev" });
  var next = el("button", { type: "button", className: "next", text: "next \u203a" });
  var where = el("span", { className: "where" });
  var go = el("input", { type: "number", min: "0", max: String(steps.length - 1), className: "goto", placeholder: "step" });
  prev.addEventListener("click", function () { turn(state.page - 1); });
  next.addEventListener("click", function () { turn(state.page + 1); });
  go.addEventListener("change", function () { var i = parseInt(go.value, 10); if (i >= 0 && i < steps.length) select(i); });
  left.appendChild(el("div", { className: "pager" }, [prev, where, next, el("label", { text: "go to step " }, [go]),
    el("span", { className: "hint", text: "\u2190 / \u2192 step" })]));
  var strip = el("div", { className: "strip" });
  left.appendChild(strip);
  var proseSpans = {}, chips = {};

  function stepOf(t) { var i = t - offset; return i >= 0 && i < steps.length ? i : null; }
  function hover(node, i) {
    node.addEventListener("mouseenter", function () { node.classList.add("hovered"); render(i); });
    node.addEventListener("mouseleave", function () { node.classList.remove("hovered"); render(state.selected); });
    node.addEventListener("click", function () { select(i); });
  }
  function drawProse() {
    prose.textContent = "";
    proseSpans = {};
    var first = 0;
    if (!isTrace && path.prompt_length > FOLD) {
      var fold = el("button", { type: "button", className: "fold", text: state.unfold ? "\u25be fold the prompt"
        : "\u25b8 " + (path.prompt_length - FOLD) + " earlier prompt tokens" });
      fold.addEventListener("click", function () { state.unfold = !state.unfold; drawProse(); setPage(state.page); });
      prose.appendChild(fold);
      if (!state.unfold) first = path.prompt_length - FOLD;
    }
    for (var t = first; t < path.tokens.length;) {
      var g = groupOf[t], last = g ? g[1] : t, own = [];
      for (var u = t; u <= last; u++) if (stepOf(u) !== null) own.push(stepOf(u));
      var special = !g && SPECIAL[path.tokens[t]];
      var span = el("span", { className: "w" + (special ? " special" : ""), text: g ? g[3] : proseOf(path.tokens[t]) });
      if (own.length) {
        var worst = own.reduce(function (a, b) { return steps[b].rank > steps[a].rank ? b : a; });
        span.dataset.step = worst;
        span.title = "step " + worst + " \u00b7 rank " + steps[worst].rank;
        if (own.some(function (i) { return !steps[i].real; })) span.classList.add("shared");
        own.forEach(function (i) { proseSpans[i] = span; });
        hover(span, worst);
      } else span.classList.add("context");
      prose.appendChild(span);
      t = last + 1;
    }
    paintProse();
  }
  function paintProse() {
    Object.keys(proseSpans).forEach(function (i) { var sp = proseSpans[i]; paint(sp, steps[+sp.dataset.step].rank); });
  }
  function chip(t) {
    var i = stepOf(t), id = path.tokens[t];
    if (i === null) return el("span", { className: "step prompt", title: "node " + id + (isTrace ? " (the start)" : " (prompt)") },
      [el("span", { className: "tok", text: lab(id) })]);
    var st = steps[i];
    var c = el("span", { className: "step" + (st.real ? "" : " shared"), data: { step: i },
      title: "step " + i + ": " + lab(st.src) + " \u2192 " + lab(st.tgt) + " \u00b7 rank " + st.rank + (st.real ? "" : " \u00b7 shared edge") },
      [el("span", { className: "tok", text: lab(st.tgt) }), el("span", { className: "e", text: fmt(st.e) })]);
    paint(c, st.rank);
    hover(c, i);
    chips[i] = c;
    return c;
  }
  function firstToken(page) {
    if (page > 0) return page * PAGE + offset;
    if (isTrace || state.unfold) return 0;
    return Math.max(0, path.prompt_length - 3);
  }
  function setPage(p) {
    state.page = Math.max(0, Math.min(pages - 1, p));
    strip.textContent = "";
    chips = {};
    var lo = state.page * PAGE, hi = Math.min(steps.length, lo + PAGE), t = firstToken(state.page);
    if (state.page === 0 && !isTrace && t > 0) {
      var fold = el("span", { className: "step prompt fold", text: "\u2026 " + t + " prompt tokens", title: "show the whole prompt" });
      fold.addEventListener("click", function () { state.unfold = true; drawProse(); setPage(0); });
      strip.appendChild(fold);
    }
    while (t < hi + offset) {
      var g = groupOf[t];
      if (!g) { strip.appendChild(chip(t)); t++; continue; }
      var end = Math.min(g[1], hi + offset - 1), pieces = el("span", { className: "pieces" });
      for (var u = t; u <= end; u++) pieces.appendChild(chip(u));
      strip.appendChild(el("span", { className: "group", title: "tokens " + g[0] + "\u2013" + g[1] + " make " + g[2] },
        [el("span", { className: "char", text: g[2] }), pieces]));
      t = end + 1;
    }
    where.textContent = "steps " + lo + "\u2013" + (hi - 1) + " of " + steps.length + " (page " + (state.page + 1) + "/" + pages + ")";
    prev.disabled = state.page === 0; next.disabled = state.page === pages - 1;
    mark();
  }
  function turn(p) { // paging moves the pinned step onto the page shown
    p = Math.max(0, Math.min(pages - 1, p));
    select(p * PAGE);
  }
  function mark() {
    Array.prototype.forEach.call(root.querySelectorAll(".selected"), function (c) { c.classList.remove("selected"); });
    var c = chips[state.selected];
    if (c) { c.classList.add("selected"); keepVisible(strip, c); }
    if (proseSpans[state.selected]) { proseSpans[state.selected].classList.add("selected"); keepVisible(prose, proseSpans[state.selected]); }
    chart.mark(state.selected);
  }
  function select(i) {
    state.selected = i;
    if (Math.floor(i / PAGE) !== state.page || !strip.firstChild) setPage(Math.floor(i / PAGE)); else mark();
    render(i);
  }
  function render(i) {
    details.textContent = "";
    details.dataset.step = i;
    details.appendChild(stepDetails(path, steps[i], i, groupOf[i + offset], positions));
  }
  drawProse();
  repainters.push(function () {
    Object.keys(chips).forEach(function (i) { paint(chips[i], steps[i].rank); });
    paintProse(); chart.repaint();
  });
  stepper[name] = function (delta) { select(Math.max(0, Math.min(steps.length - 1, state.selected + delta))); };
  select(worstStep(steps));
  return { select: select };
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
