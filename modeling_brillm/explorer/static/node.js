
var pathViews = {}; // view name -> the path view (its select), so a node's visits can open their steps

// The Node view: a node's real outgoing edges ranked by the energy each delivered, apart from the shared edge,
// whose tied targets make one row each with their count.
function nodeView(root) {
  var added = {};
  (DATA.added || []).forEach(function (u) { added[u] = true; });
  var ids = Object.keys(DATA.nodes).map(Number), listed = ids.filter(function (u) { return DATA.nodes[u].count > 0 || added[u]; });
  listed.sort(function (a, b) { return DATA.nodes[b].count - DATA.nodes[a].count || a - b; });
  root.appendChild(el("p", { className: "hint", text: "A node's real outgoing edges, ranked by the mean energy each " +
    "edge u\u2192v delivered over the steps where the signal sat on u in the text(s) (for a node they never visit: " +
    "after the path <BOS> u), apart from the shared edge that serves every other target. Click a token to follow it." }));
  var pick = el("select", { className: "pick" });
  listed.forEach(function (u) {
    var n = DATA.nodes[u].count;
    pick.appendChild(el("option", { value: String(u), text: lab(u) + "  (node " + u + ", " + (n ? n + " visit" + (n === 1 ? "" : "s") : "added") + ")" }));
  });
  pick.addEventListener("change", function () { select(Number(pick.value)); });
  root.appendChild(el("label", { text: "node " }, [pick]));
  var box = el("div", { className: "details", style: "margin-top:8px" });
  root.appendChild(box);
  function select(u) {
    box.textContent = "";
    box.dataset.node = u;
    box.appendChild(el("h3", {}, [tok(u), "  (node " + u + ")"]));
    if (pick.querySelector('option[value="' + u + '"]')) pick.value = String(u);
    nodeDetails(box, u, DATA.nodes[String(u)]);
  }
  var first = DATA.focus !== null && DATA.focus !== undefined ? DATA.focus : listed.length ? listed[0] : ids[0];
  if (first !== undefined) select(first);
  return { select: select };
}

function nodeDetails(box, u, h) {
  if (!h) {
    box.appendChild(el("p", { className: "missing", text: "This page holds no edges for node " + u + ": write the page " +
      "with --node " + u + " (in Python: nodes=[" + u + "]) to add them." }));
    return;
  }
  box.appendChild(el("p", { className: "hint", text: h.measure + " \u00b7 " + h.degree + " real outgoing edge" +
    (h.degree === 1 ? "" : "s") + " of " + M.vocab_size + " nodes" }));
  box.appendChild(nodeVisits(u));
  box.appendChild(el("h4", { text: "real edges, strongest first" }));
  box.appendChild(realTable(h));
  if (!h.shared.length) return;
  box.appendChild(el("h4", { text: "the shared edge (every target without a real edge)" }));
  box.appendChild(sharedTable(h));
  var best = h.real.length ? h.real[0][1] : null, top = h.shared[0];
  if (best === null || top[0] > best) box.appendChild(el("p", { className: "note", text: "The shared edge delivers " +
    "more than " + (best === null ? "any real edge (this node has none)" : "this node's best real edge (" + fmt(top[0]) +
    " > " + fmt(best) + ")") + ": its strongest targets are " + top[1] + " node(s) it has no edge to" +
    (top[1] > 1 ? ", tied." : ".") }));
}

// The steps of the page's paths where the signal sits on u, each a link to its step.
function nodeVisits(u) {
  var out = el("p", { className: "visits hint" }, ["the signal sits here at "]), any = false;
  DATA.paths.forEach(function (p) {
    var name = p.kind === "trace" ? "trace" : "generation", at = [];
    p.steps.forEach(function (st, i) { if (st.src === u) at.push(i); });
    if (!at.length) return;
    any = true;
    out.appendChild(document.createTextNode((p.kind === "trace" ? "text" : "generation") + " step" + (at.length > 1 ? "s " : " ")));
    at.slice(0, 20).forEach(function (i) {
      var a = el("a", { href: "#", className: "steplink", text: String(i), data: { step: i, view: name } });
      a.addEventListener("click", function (ev) { ev.preventDefault(); show(name); pathViews[name].select(i); });
      out.appendChild(a);
      out.appendChild(document.createTextNode(" "));
    });
    if (at.length > 20) out.appendChild(document.createTextNode("\u2026 "));
  });
  if (!any) out.textContent = "no step of the page's paths leaves this node";
  return out;
}

function realTable(h) {
  if (!h.real.length) return el("p", { className: "hint", text: "no real outgoing edges: every target is served by the shared edge." });
  var table = el("table", { className: "edges" }, [head(["#", "target", h.count ? "mean energy" : "energy", "rank of " + M.vocab_size, ""])]);
  var top = Math.max(h.real[0][1] || 0, h.shared.length ? h.shared[0][0] || 0 : 0) || 1;
  h.real.forEach(function (e, r) {
    table.appendChild(el("tr", { className: "edge", data: { token: e[0] } }, [el("td", { className: "num", text: String(r + 1) }),
      el("td", {}, [nodeLink(e[0])]), el("td", { className: "num e", text: fmt(e[1]) }),
      el("td", { className: "num rank", text: String(e[2]) }), el("td", { className: "barcell" }, [bar(e[1] === null ? 0 : e[1], top)])]));
  });
  return table;
}

function sharedTable(h) {
  var table = el("table", { className: "shared-edge" }, [head([h.count ? "mean energy" : "energy", "targets", "rank of " + M.vocab_size, "e.g."])]);
  h.shared.forEach(function (s) {
    var examples = el("td", {}, []);
    s[3].forEach(function (v) { examples.appendChild(nodeLink(v)); examples.appendChild(document.createTextNode(" ")); });
    if (s[1] > s[3].length) examples.appendChild(document.createTextNode("\u2026"));
    table.appendChild(el("tr", { className: "tie", data: { count: s[1] } }, [el("td", { className: "num e", text: fmt(s[0]) }),
      el("td", { className: "num count", text: s[1] === 1 ? "1 node" : s[1] + " nodes tie" }),
      el("td", { className: "num rank", text: String(s[2]) }), examples]));
  });
  return table;
}
