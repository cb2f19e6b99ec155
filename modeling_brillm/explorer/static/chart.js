
// Ticks at round values (1, 2 or 5 times a power of ten) covering [lo, hi].
function niceTicks(lo, hi, count, whole) {
  var span = hi - lo, raw = span / Math.max(1, count), mag = Math.pow(10, Math.floor(Math.log10(raw)));
  var unit = [1, 2, 5, 10].map(function (f) { return f * mag; }).filter(function (u) { return u >= raw; })[0] || 10 * mag;
  if (whole) unit = Math.max(1, Math.round(unit)); // step numbers are whole
  var out = [];
  for (var t = Math.ceil(lo / unit) * unit; t <= hi + 1e-9 * span; t += unit) out.push(Math.abs(t) < 1e-12 ? 0 : t);
  return out;
}
function pointColour(rank) {
  if (settings.colour !== "continuous") return pointShade(rank);
  var t = Math.log(Math.max(1, rank)) / Math.log(Math.max(2, M.vocab_size || 2));
  return "hsl(" + Math.round(130 * (1 - t)) + ", 70%, 40%)";
}

// The chart's frame: its size, the energy range of every series (padded), and where a step and an energy are drawn.
function chartFrame(series) {
  var f = { W: 1000, H: 170, L: 54, R: 10, T: 10, B: 34, n: series[0].steps.length }, all = [];
  series.forEach(function (s) { s.steps.forEach(function (st) { if (st.e !== null) all.push(st.e); }); });
  f.lo = all.length ? Math.min.apply(null, all) : 0;
  f.hi = all.length ? Math.max.apply(null, all) : 1;
  if (f.hi <= f.lo) f.hi = f.lo + 1;
  var pad = 0.05 * (f.hi - f.lo);
  f.lo -= pad; f.hi += pad;
  f.x = function (i) { return f.n === 1 ? f.L + (f.W - f.L - f.R) / 2 : f.L + (f.W - f.L - f.R) * i / (f.n - 1); };
  f.y = function (v) { return f.T + (f.H - f.T - f.B) * (1 - (v - f.lo) / (f.hi - f.lo)); };
  return f;
}

// The axes: energy ticks with grid lines, step ticks (whole numbers), and the two labels.
function chartAxes(f) {
  var axes = svg("g", { class: "axes" }), bottom = f.H - f.B;
  niceTicks(f.lo, f.hi, 4).forEach(function (v) {
    axes.appendChild(svg("line", { x1: f.L, x2: f.W - f.R, y1: f.y(v), y2: f.y(v), class: "grid" }));
    axes.appendChild(svg("text", { x: f.L - 6, y: f.y(v) + 4, "text-anchor": "end", class: "tick" }, fmt(v, f.hi - f.lo < 2 ? 2 : 1)));
  });
  niceTicks(0, Math.max(1, f.n - 1), 8, true).forEach(function (i) {
    if (i > f.n - 1) return;
    axes.appendChild(svg("line", { x1: f.x(i), x2: f.x(i), y1: bottom, y2: bottom + 4, class: "axis" }));
    axes.appendChild(svg("text", { x: f.x(i), y: bottom + 16, "text-anchor": "middle", class: "tick" }, String(i)));
  });
  axes.appendChild(svg("line", { x1: f.L, x2: f.L, y1: f.T, y2: bottom, class: "axis" }));
  axes.appendChild(svg("line", { x1: f.L, x2: f.W - f.R, y1: bottom, y2: bottom, class: "axis" }));
  axes.appendChild(svg("text", { x: (f.L + f.W - f.R) / 2, y: f.H - 2, "text-anchor": "middle", class: "label" }, "step"));
  axes.appendChild(svg("text", { x: 12, y: (f.T + bottom) / 2, "text-anchor": "middle", class: "label",
    transform: "rotate(-90 12 " + (f.T + bottom) / 2 + ")" }, "energy"));
  return axes;
}

// The energy of every step against its index, with axes: one line per series (a path, or the two models of a diff),
// each step a point coloured by its rank (hollow where the step crossed the shared edge); a click picks the nearest
// step, and a vertical line marks the pinned one.
function energyChart(series, onPick) {
  var f = chartFrame(series), n = f.n, points = [];
  var box = svg("svg", { viewBox: "0 0 " + f.W + " " + f.H, class: "chart", role: "img" });
  box.appendChild(svg("title", {}, "energy of every step (" + fmt(f.lo) + " to " + fmt(f.hi) + "); click to jump to a step"));
  box.appendChild(chartAxes(f));
  var radius = n > 600 ? 1.6 : n > 120 ? 2.4 : 3.4;
  series.forEach(function (s, k) {
    var line = s.steps.map(function (st, i) { return st.e === null ? null : f.x(i).toFixed(1) + "," + f.y(st.e).toFixed(1); });
    box.appendChild(svg("polyline", { points: line.filter(Boolean).join(" "), class: "series s" + k, fill: "none" }));
    var dots = svg("g", { class: "points s" + k });
    s.steps.forEach(function (st, i) {
      if (st.e === null) return;
      var c = svg("circle", { cx: f.x(i).toFixed(1), cy: f.y(st.e).toFixed(1), r: radius, "data-step": i, class: st.real ? "real" : "shared" });
      c.appendChild(svg("title", {}, (s.name ? s.name + ": " : "") + "step " + i + " \u00b7 energy " + fmt(st.e) + " \u00b7 rank " + st.rank));
      dots.appendChild(c);
      points.push([c, st]);
    });
    box.appendChild(dots);
  });
  var marker = svg("line", { y1: f.T, y2: f.H - f.B, class: "marker" });
  box.appendChild(marker);
  function repaint() {
    if (series.length > 1) return; // a diff's two series keep their own colours
    points.forEach(function (p) {
      var colour = pointColour(p[1].rank);
      p[0].style.fill = p[1].real ? colour : "#fff";
      p[0].style.stroke = colour;
    });
  }
  repaint();
  box.addEventListener("click", function (ev) {
    var pt = box.createSVGPoint();
    pt.x = ev.clientX; pt.y = ev.clientY;
    var at = pt.matrixTransform(box.getScreenCTM().inverse());
    onPick(Math.max(0, Math.min(n - 1, Math.round(n === 1 ? 0 : (at.x - f.L) / (f.W - f.L - f.R) * (n - 1)))));
  });
  return { svg: box, repaint: repaint, mark: function (i) { marker.setAttribute("x1", f.x(i)); marker.setAttribute("x2", f.x(i)); } };
}
