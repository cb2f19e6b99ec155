
// The colour of a rank change from model A to model B: green where B ranks the true token higher, red where
// lower, stronger with the factor between the ranks (on a log scale up to V).
function changeShade(ra, rb) {
  if (ra === rb) return "";
  var t = Math.min(1, Math.abs(Math.log(rb / ra)) / Math.log(Math.max(2, M.vocab_size || 2)) * 3);
  return rb < ra ? "hsl(130, 60%, " + Math.round(92 - 30 * t) + "%)" : "hsl(4, 75%, " + Math.round(93 - 28 * t) + "%)";
}
function factor(ra, rb) {
  if (ra === rb) return "=";
  var f = Math.max(ra, rb) / Math.min(ra, rb);
  return "\u00d7" + f.toFixed(f < 10 ? 1 : 0) + (rb < ra ? " better" : " worse");
}
function change(A, B, i) { return Math.abs(Math.log(B.steps[i].rank / A.steps[i].rank)); }

// The diff view: one text through two models. Both energies per step on one chart, the text coloured by how the
// true token's rank changed, the steps whose rank changed most, and one step's facts side by side.
function diffView(root) {
  var A = DATA.paths[0], B = DATA.paths[1], names = DATA.diff.names, state = { selected: 0 };
  root.appendChild(diffSummary(A, B, names));
  root.appendChild(el("div", { className: "legend hint" }, [el("span", { className: "swatch s0" }), names[0] + "  ",
    el("span", { className: "swatch s1" }), names[1] + " \u00b7 text: ", el("span", { className: "better", text: "ranks higher in " + names[1] }),
    " ", el("span", { className: "worse", text: "ranks lower in " + names[1] })]));
  var prose = el("div", { className: "prose" }), spans = {};
  root.appendChild(el("div", { className: "prose-box" }, [el("h4", { text: "the text, by the change in rank" }), prose]));
  proseWords(prose, A, groupIndex(A), 0, 1, function (span, own) {
    var i = own.reduce(function (x, y) { return change(A, B, y) > change(A, B, x) ? y : x; });
    span.dataset.step = i;
    span.title = "step " + i + ": rank " + A.steps[i].rank + " \u2192 " + B.steps[i].rank;
    span.style.background = changeShade(A.steps[i].rank, B.steps[i].rank);
    own.forEach(function (k) { spans[k] = span; });
    span.addEventListener("mouseenter", function () { render(i); });
    span.addEventListener("mouseleave", function () { render(state.selected); });
    span.addEventListener("click", function () { select(i); });
  });
  var layout = el("div", { className: "layout" }), left = el("div"), details = el("div", { className: "details" });
  layout.appendChild(left); layout.appendChild(details); root.appendChild(layout);
  var chart = energyChart([{ steps: A.steps, name: names[0] }, { steps: B.steps, name: names[1] }], function (i) { select(i); });
  var table = changedTable(A, B, names, function (i) { select(i); });
  left.appendChild(chart.svg);
  left.appendChild(el("h4", { text: "the steps whose rank changed most" }));
  left.appendChild(DATA.diff.changed.length ? table : el("p", { className: "hint", text: "no step's rank changed." }));
  function select(i) {
    state.selected = i;
    Array.prototype.forEach.call(root.querySelectorAll(".selected"), function (c) { c.classList.remove("selected"); });
    if (spans[i]) { spans[i].classList.add("selected"); keepVisible(prose, spans[i]); }
    var r = table.querySelector('tr[data-step="' + i + '"]');
    if (r) r.classList.add("selected");
    chart.mark(i);
    render(i);
  }
  function render(i) {
    details.textContent = "";
    details.dataset.step = i;
    details.appendChild(diffDetails(A.steps[i], B.steps[i], i, names));
  }
  stepper.diff = function (delta) { select(Math.max(0, Math.min(A.steps.length - 1, state.selected + delta))); };
  select(DATA.diff.changed.length ? DATA.diff.changed[0] : 0);
}

function diffSummary(A, B, names) {
  var summary = el("table", { className: "diffsum" }, [head(["", names[0], names[1]])]);
  [["perplexity", "perplexity", 3], ["top-1", "top1_accuracy", -1], ["mean rank", "mean_rank", 2]].forEach(function (m) {
    var cells = [A, B].map(function (p) {
      var v = p.summary[m[1]];
      return el("td", { className: "num", data: { metric: m[1] }, text: m[2] < 0 ? pct(v) : fmt(v, m[2]) });
    });
    summary.appendChild(el("tr", {}, [el("th", { text: m[0] })].concat(cells)));
  });
  return summary;
}

function changedTable(A, B, names, onPick) {
  var table = el("table", { className: "changed" }, [head(["step", "token", "rank " + names[0], "rank " + names[1],
    "change", "energy " + names[0], "energy " + names[1]])]);
  DATA.diff.changed.forEach(function (i) {
    var a = A.steps[i], b = B.steps[i];
    var r = el("tr", { className: "changed-step", data: { step: i } }, [el("td", { className: "num", text: String(i) }),
      el("td", {}, [tok(a.src), " \u2192 ", tok(a.tgt)]), el("td", { className: "num ra", text: String(a.rank) }),
      el("td", { className: "num rb", text: String(b.rank) }), el("td", { text: factor(a.rank, b.rank) }),
      el("td", { className: "num", text: fmt(a.e) }), el("td", { className: "num", text: fmt(b.e) })]);
    r.style.background = changeShade(a.rank, b.rank);
    r.addEventListener("click", function () { onPick(i); });
    table.appendChild(r);
  });
  return table;
}

function diffDetails(a, b, i, names) {
  var box = el("div");
  box.appendChild(el("h3", {}, ["Step " + i + ": ", tok(a.src), " \u2192 ", tok(a.tgt)]));
  var facts = el("table", { className: "facts both" }, [head(["", names[0], names[1]])]);
  [["energy", "energy", function (s) { return fmt(s.e); }], ["rank", "rank", function (s) { return s.rank + " of " + M.vocab_size; }],
    ["probability", "probability", function (s) { return fmt(s.p, 4); }],
    ["model's pick", "predicted", function (s) { return s.rank === 1 ? "the true next token" : lab(s.pred) + " (" + fmt(s.pe) + ")"; }],
    ["edge", "edge", function (s) { return s.real ? "real" : "shared"; }]].forEach(function (f) {
    facts.appendChild(el("tr", {}, [el("th", { text: f[0] }), el("td", { data: { field: f[1] + "-a" }, text: f[2](a) }),
      el("td", { data: { field: f[1] + "-b" }, text: f[2](b) })]));
  });
  box.appendChild(facts);
  box.appendChild(el("p", { className: "hint", text: "change: " + factor(a.rank, b.rank) + " in " + names[1] }));
  return box;
}
