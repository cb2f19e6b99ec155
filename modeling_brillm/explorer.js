// BriLLM explorer: renders the JSON that modeling_brillm/explorer.py embeds in the page. Every token text goes
// into the page as text (textContent), never as markup.
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("brillm-data").textContent);
  var PAGE = 200; // steps per page: a 2,000-token text stays quick to draw
  var SVGNS = "http://www.w3.org/2000/svg";
  var app = document.getElementById("app");

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
    (children || []).forEach(function (child) { if (child) node.appendChild(child); });
    return node;
  }
  function fmt(x, digits) { return x === null || x === undefined ? "\u2013" : x.toFixed(digits === undefined ? 3 : digits); }
  function pct(x) { return (100 * x).toFixed(1) + "%"; }
  function lab(id) { var t = DATA.labels[String(id)]; return t === undefined ? "#" + id : t; }
  function rankClass(rank) { return rank === 1 ? "r1" : rank <= 10 ? "r2" : "r3"; }
  function tok(id, cls) { return el("span", { className: "tok" + (cls ? " " + cls : ""), text: lab(id), title: "node " + id }); }

  // The weights of the signal's mix at position i: softmax over the weight logits of the edges entering tokens 1..i
  // (past the trained positions every edge uses the last logit, as the model does).
  function mixWeights(i) {
    var P = DATA.positions, M = P.length, logits = [], top = -Infinity, sum = 0, k;
    for (k = 1; k <= i; k++) { logits.push(P[Math.min(k - 1, M - 1)]); top = Math.max(top, logits[k - 1]); }
    var w = logits.map(function (p) { var e = Math.exp(p - top); sum += e; return e; });
    return w.map(function (e) { return e / sum; });
  }

  if (DATA.error) {
    app.appendChild(el("header", {}, [el("h1", { text: DATA.title || "BriLLM explorer" })]));
    app.appendChild(el("div", { className: "error", id: "error", text: DATA.error }));
    document.body.dataset.ready = "1";
    return;
  }

  var M = DATA.model;
  app.appendChild(el("header", {}, [
    el("h1", { text: DATA.title }),
    el("span", { className: "meta", text: M.name + " \u00b7 " + M.vocab_size + " nodes \u00b7 " + M.graph +
      " graph \u00b7 " + M.max_positions + " trained positions" + (M.extend ? " (reads past them)" : "") })]));
  var trace = null, generation = null;
  DATA.paths.forEach(function (p) { if (p.kind === "trace") trace = p; else generation = p; });
  var views = {}, tabs = {};
  var nav = el("nav", { role: "tablist" });
  app.appendChild(nav);
  [["trace", "Text path", trace], ["generation", "Generation", generation], ["node", "Node", true]].forEach(function (t) {
    var button = el("button", { text: t[1], id: "tab-" + t[0], type: "button" });
    if (!t[2]) { button.disabled = true; button.title = t[0] === "trace" ? "no text was traced" : "nothing was generated"; }
    button.addEventListener("click", function () { show(t[0]); });
    nav.appendChild(button);
    tabs[t[0]] = button;
    views[t[0]] = el("section", { id: "view-" + t[0], hidden: "" });
    app.appendChild(views[t[0]]);
  });
  function show(name) {
    Object.keys(views).forEach(function (v) {
      views[v].hidden = v !== name;
      tabs[v].classList.toggle("active", v === name);
    });
  }
  function nodeLink(id) {
    var a = el("a", { className: "node tok", text: lab(id), title: "node " + id + ": its strongest edges" });
    a.addEventListener("click", function () { nodeView.select(id); show("node"); });
    return a;
  }
  function row(name, field, content) {
    var cell = el("td", { data: { field: field } }, content instanceof Node ? [content] : []);
    if (!(content instanceof Node)) cell.textContent = content;
    return el("tr", {}, [el("th", { text: name }), cell]);
  }
  function bar(value, max) { return el("div", { className: "bar", style: "width:" + Math.max(2, 100 * value / max) + "%" }); }

  function pathView(path, root) {
    var steps = path.steps, isTrace = path.kind === "trace", state = { page: 0, selected: 0 };
    var s = path.summary;
    root.appendChild(el("div", { className: "summary" , text: isTrace
      ? steps.length + " steps \u00b7 perplexity " + fmt(s.perplexity) + " \u00b7 top-1 " + pct(s.top1_accuracy) +
        " \u00b7 mean rank " + fmt(s.mean_rank, 2)
      : "prompt of " + path.prompt_length + " token(s), " + steps.length + " generated" }));
    root.appendChild(el("div", { className: "legend hint" }, [
      el("span", { className: "step r1", text: "rank 1" }), el("span", { className: "step r2", text: "rank 2\u201310" }),
      el("span", { className: "step r3", text: "rank > 10" }), el("span", { className: "step shared", text: "shared edge" }),
      document.createTextNode(isTrace ? "each box: the true next token and the energy its edge delivers; hover or click a step"
        : "each box: the chosen token and its energy; hover or click a step")]));
    if (!steps.length) { root.appendChild(el("p", { className: "hint", text: "no steps (nothing was generated)." })); return; }
    var layout = el("div", { className: "layout" }), left = el("div"), details = el("div", { className: "details" });
    layout.appendChild(left); layout.appendChild(details); root.appendChild(layout);
    var chart = energyChart(steps, function (i) { select(i); });
    left.appendChild(chart.svg);
    var pages = Math.ceil(steps.length / PAGE);
    var prev = el("button", { type: "button", className: "prev", text: "\u2039 prev" });
    var next = el("button", { type: "button", className: "next", text: "next \u203a" });
    var where = el("span", { className: "where" });
    var go = el("input", { type: "number", min: "0", max: String(steps.length - 1), className: "goto", placeholder: "step" });
    prev.addEventListener("click", function () { setPage(state.page - 1); });
    next.addEventListener("click", function () { setPage(state.page + 1); });
    go.addEventListener("change", function () { var i = parseInt(go.value, 10); if (i >= 0 && i < steps.length) select(i); });
    left.appendChild(el("div", { className: "pager" }, [prev, where, next, el("label", { text: "go to step " }, [go])]));
    var strip = el("div", { className: "strip" });
    left.appendChild(strip);

    function chip(i) {
      var st = steps[i];
      var c = el("span", { className: "step " + rankClass(st.rank) + (st.real ? "" : " shared"), data: { step: i },
        title: "step " + i + ": " + lab(st.src) + " \u2192 " + lab(st.tgt) + " \u00b7 rank " + st.rank },
        [el("span", { className: "tok", text: lab(st.tgt) }), el("span", { className: "e", text: fmt(st.e) })]);
      c.addEventListener("mouseenter", function () { c.classList.add("hovered"); render(i); });
      c.addEventListener("mouseleave", function () { c.classList.remove("hovered"); render(state.selected); });
      c.addEventListener("click", function () { select(i); });
      return c;
    }
    function setPage(p) {
      state.page = Math.max(0, Math.min(pages - 1, p));
      strip.textContent = "";
      var lo = state.page * PAGE, hi = Math.min(steps.length, lo + PAGE);
      if (lo === 0) { // the tokens before the first step: the start node, or the prompt
        var before = isTrace ? path.tokens.slice(0, 1) : path.tokens.slice(0, path.prompt_length);
        before.forEach(function (t) {
          strip.appendChild(el("span", { className: "step prompt", title: "node " + t }, [el("span", { className: "tok", text: lab(t) })]));
        });
      }
      for (var i = lo; i < hi; i++) strip.appendChild(chip(i));
      where.textContent = "steps " + lo + "\u2013" + (hi - 1) + " of " + steps.length + " (page " + (state.page + 1) + "/" + pages + ")";
      prev.disabled = state.page === 0; next.disabled = state.page === pages - 1;
      mark();
    }
    function mark() {
      Array.prototype.forEach.call(strip.querySelectorAll(".step.selected"), function (c) { c.classList.remove("selected"); });
      var c = strip.querySelector('.step[data-step="' + state.selected + '"]');
      if (c) c.classList.add("selected");
      chart.mark(state.selected);
    }
    function select(i) {
      state.selected = i;
      if (Math.floor(i / PAGE) !== state.page) setPage(Math.floor(i / PAGE)); else mark();
      render(i);
    }
    function render(i) {
      var st = steps[i];
      details.textContent = "";
      details.dataset.step = i;
      details.appendChild(el("h3", {}, [document.createTextNode("Step " + i + ": "), tok(st.src), document.createTextNode(" \u2192 "), tok(st.tgt)]));
      var table = el("table", { className: "facts" });
      table.appendChild(row("signal sits on", "source", nodeLink(st.src)));
      table.appendChild(row(isTrace ? "true next token" : "chosen token", "target", nodeLink(st.tgt)));
      table.appendChild(row("energy", "energy", fmt(st.e)));
      table.appendChild(row("rank", "rank", st.rank + " of " + M.vocab_size));
      table.appendChild(row(isTrace ? "probability" : "probability (decoding)", "probability", fmt(st.p, 4)));
      if (isTrace) table.appendChild(row("model's pick", "predicted", st.rank === 1 ? "the true next token"
        : lab(st.pred) + " (" + fmt(st.pe) + ")"));
      table.appendChild(row("edge", "edge", st.real ? "real edge of the graph" : "the shared edge (no real edge)"));
      details.appendChild(table);
      details.appendChild(el("h4", { text: isTrace ? "strongest alternatives" : "runner-ups" }));
      var alts = el("table", { className: "alts" }), top = st.e;
      st.alts.forEach(function (a) { if (a[1] !== null) top = Math.max(top, a[1]); });
      alts.appendChild(altRow(el("span", { className: "tok", text: lab(st.tgt) + (isTrace ? " (true)" : " (chosen)") }), st.e, top, "target"));
      st.alts.forEach(function (a) { alts.appendChild(altRow(nodeLink(a[0]), a[1], top, "alt", a[0])); });
      details.appendChild(alts);
      details.appendChild(el("h4", { text: "signal mix x" + sub(st.i) + " over the edges crossed so far" }));
      details.appendChild(mixList(path.tokens, st.i));
    }
    function altRow(content, energy, top, cls, id) {
      var r = el("tr", { className: cls }, [el("td", {}, [content]), el("td", { className: "num e", text: fmt(energy) }),
        el("td", { style: "width:40%" }, [bar(energy === null ? 0 : energy, top || 1)])]);
      if (id !== undefined) r.dataset.token = id;
      return r;
    }
    setPage(0); select(0);
  }
  function sub(i) { return String(i).split("").map(function (c) { return String.fromCharCode(0x2080 + +c); }).join(""); }

  // The strongest contributions to the signal at position i (the edge entering token k carries weight w_k).
  function mixList(tokens, i) {
    var box = el("div", { className: "mix" });
    if (i === 0) { box.appendChild(el("p", { className: "hint", text: "the start signal e\u2080: no edge crossed yet" })); return box; }
    var w = mixWeights(i), order = w.map(function (_, k) { return k; });
    order.sort(function (a, b) { return w[b] - w[a] || b - a; });
    var table = el("table", { className: "mixtable" });
    order.slice(0, 8).forEach(function (k) {
      var position = k + 1;
      var edge = el("td", {}, [tok(tokens[position - 1]), document.createTextNode(" \u2192 "), tok(tokens[position])]);
      table.appendChild(el("tr", { data: { position: position, weight: w[k] } }, [el("td", { className: "num", text: "pos " + position }), edge,
        el("td", { className: "num w", text: pct(w[k]) }), el("td", { style: "width:30%" }, [bar(w[k], w[order[0]])])]));
    });
    box.appendChild(table);
    box.appendChild(el("p", { className: "hint", text: i + " edge(s) in the mix" + (i > 8 ? ", the 8 strongest shown" : "") +
      "; the latest edge weighs " + pct(w[i - 1]) + " (softmax of the position weights)" }));
    return box;
  }

  // Energy of every step as a line; a click picks the nearest step.
  function energyChart(steps, onPick) {
    var W = 1000, H = 70, n = steps.length, vals = steps.map(function (s) { return s.e === null ? 0 : s.e; });
    var lo = Math.min.apply(null, vals), hi = Math.max.apply(null, vals);
    if (hi <= lo) hi = lo + 1;
    function x(i) { return n === 1 ? W / 2 : 4 + (W - 8) * i / (n - 1); }
    function y(v) { return H - 6 - (H - 12) * (v - lo) / (hi - lo); }
    var svg = document.createElementNS(SVGNS, "svg");
    svg.setAttribute("viewBox", "0 0 " + W + " " + H); svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("class", "chart");
    var title = document.createElementNS(SVGNS, "title");
    title.textContent = "energy of every step (" + fmt(lo) + " to " + fmt(hi) + "); click to jump";
    svg.appendChild(title);
    var line = document.createElementNS(SVGNS, "polyline");
    line.setAttribute("points", vals.map(function (v, i) { return x(i).toFixed(1) + "," + y(v).toFixed(1); }).join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", "#2f5fd0"); line.setAttribute("stroke-width", "1.2");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.appendChild(line);
    var marker = document.createElementNS(SVGNS, "line");
    marker.setAttribute("y1", "0"); marker.setAttribute("y2", String(H)); marker.setAttribute("stroke", "#d04a2f");
    marker.setAttribute("vector-effect", "non-scaling-stroke");
    svg.appendChild(marker);
    svg.addEventListener("click", function (ev) {
      var box = svg.getBoundingClientRect(), f = (ev.clientX - box.left) / Math.max(1, box.width);
      onPick(Math.max(0, Math.min(n - 1, Math.round((f * W - 4) / (W - 8) * (n - 1)))));
    });
    return { svg: svg, mark: function (i) { marker.setAttribute("x1", x(i)); marker.setAttribute("x2", x(i)); } };
  }

  // The Node view: a node's strongest outgoing edges and where they lead.
  var nodeView = (function (root) {
    var ids = Object.keys(DATA.nodes).map(Number);
    ids.sort(function (a, b) { return DATA.nodes[b].count - DATA.nodes[a].count || a - b; });
    root.appendChild(el("p", { className: "hint", text: "A node's strongest outgoing edges: the mean energy each edge " +
      "u\u2192v delivered over the steps where the signal sat on u in the text(s) above (for a node they never visit: " +
      "after the path <BOS> u). Click a token to follow its edges." }));
    var pick = el("select", { className: "pick" });
    ids.forEach(function (u) { pick.appendChild(el("option", { value: String(u), text: lab(u) + "  (node " + u + ", " + DATA.nodes[u].count + " visits)" })); });
    pick.addEventListener("change", function () { select(Number(pick.value)); });
    root.appendChild(el("label", { text: "node " }, [pick]));
    var box = el("div", { className: "details", style: "margin-top:8px" });
    root.appendChild(box);
    function select(u) {
      var h = DATA.nodes[String(u)];
      box.textContent = "";
      box.dataset.node = u;
      if (!h) { box.appendChild(el("p", { className: "hint", text: "no edges recorded for node " + u + "." })); return; }
      pick.value = String(u);
      box.appendChild(el("h3", {}, [tok(u), document.createTextNode("  (node " + u + ")")]));
      box.appendChild(el("p", { className: "hint", text: h.measure + (h.degree === null ? "" : " \u00b7 " + h.degree + " real outgoing edge(s)") }));
      var table = el("table", { className: "edges" }), top = h.edges.length ? h.edges[0][1] : 1;
      h.edges.forEach(function (e, r) {
        var target = DATA.nodes[String(e[0])] ? nodeLink(e[0]) : tok(e[0]);
        table.appendChild(el("tr", { className: "edge", data: { token: e[0] } }, [el("td", { className: "num", text: String(r + 1) }),
          el("td", {}, [target]), el("td", { className: "num e", text: fmt(e[1]) }),
          el("td", { style: "width:35%" }, [bar(e[1] === null ? 0 : e[1], top || 1)]),
          el("td", { className: "hint", text: e[2] ? "real" : "shared" })]));
      });
      box.appendChild(table);
    }
    if (ids.length) select(DATA.focus !== null && DATA.focus !== undefined ? DATA.focus : ids[0]);
    return { select: select };
  })(views.node);

  if (trace) pathView(trace, views.trace);
  if (generation) pathView(generation, views.generation);
  show(trace ? "trace" : generation ? "generation" : "node");
  document.body.dataset.ready = "1";
})();
