
// The page: a header naming the model, the tabs of its views, the colour switch, and ← / → to step.
if (DATA.error) {
  app.appendChild(el("header", {}, [el("h1", { text: DATA.title || "BriLLM explorer" })]));
  app.appendChild(el("div", { className: "error", id: "error", text: DATA.error }));
  document.body.dataset.ready = "1";
  return;
}
var colours = el("select", { className: "colours", id: "colours", title: "how the rank of a step colours it" }, [
  el("option", { value: "buckets", text: "rank: 1 / 2\u201310 / worse" }), el("option", { value: "continuous", text: "rank: continuous scale" })]);
colours.addEventListener("change", function () { setColour(colours.value); });
app.appendChild(el("header", {}, [
  el("h1", { text: DATA.title }),
  el("span", { className: "meta", text: M.vocab_size + " nodes \u00b7 " + M.graph + " graph" +
    (M.edges ? " (" + M.edges + " real edges)" : "") + " \u00b7 " + M.max_positions + " trained positions" +
    (M.extend ? " (reads past them)" : "") }),
  el("label", { className: "meta", text: "colour by " }, [colours])]));
var trace = null, generation = null;
DATA.paths.forEach(function (p) { if (p.kind === "trace") trace = trace || p; else generation = p; });
var nav = el("nav", { role: "tablist" });
app.appendChild(nav);
var tabList = DATA.diff
  ? [["diff", "Diff", true], ["a", "Text: " + DATA.diff.names[0], true], ["b", "Text: " + DATA.diff.names[1], true]]
  : [["trace", "Text path", trace], ["generation", "Generation", generation], ["node", "Node", true]];
tabList.forEach(function (t) {
  var button = el("button", { text: t[1], id: "tab-" + t[0], type: "button", role: "tab" });
  if (!t[2]) { button.disabled = true; button.title = t[0] === "trace" ? "no text was traced" : "nothing was generated"; }
  button.addEventListener("click", function () { show(t[0]); });
  nav.appendChild(button);
  tabs[t[0]] = button;
  views[t[0]] = el("section", { id: "view-" + t[0], hidden: "" });
  app.appendChild(views[t[0]]);
});
document.addEventListener("keydown", function (ev) {
  var typing = ev.target && /^(INPUT|SELECT|TEXTAREA)$/.test(ev.target.tagName);
  if (typing || ev.altKey || ev.ctrlKey || ev.metaKey || !stepper[active]) return;
  if (ev.key === "ArrowRight" || ev.key === "ArrowLeft") {
    ev.preventDefault();
    stepper[active](ev.key === "ArrowRight" ? 1 : -1);
  }
});
if (DATA.diff) {
  diffView(views.diff);
  pathViews.a = pathView(DATA.paths[0], views.a, "a");
  pathViews.b = pathView(DATA.paths[1], views.b, "b");
  show("diff");
} else {
  var nodes = nodeView(views.node);
  openNode = function (id) { nodes.select(id); show("node"); };
  if (trace) pathViews.trace = pathView(trace, views.trace, "trace");
  if (generation) pathViews.generation = pathView(generation, views.generation, "generation");
  show(trace ? "trace" : generation ? "generation" : "node");
}
document.body.dataset.ready = "1";
