
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

// The energy of every step against its index, with axes: one line per series (a path, or the two models of a diff),
// each step a point coloured by its rank (hollow where the step crossed the shared edge); a click picks the nearest
// step, and a vertical line marks the pinned one.
function energyChart(series, onPick) {
  var W = 1000, H = 170, L = 54, R = 10, T = 10, B = 34, n = series[0].steps.length;
  var all = [];
  series.forEach(function (s) { s.steps.forEach(function (st) { if (st.e !== null) all.push(st.e); }); });
  var lo = all.length ? Math.min.apply(null, all) : 0, hi = all.length ? Math.max.apply(null, all) : 1;
  if (hi <= lo) { hi = lo + 1; }
  var pad = 0.05 * (hi - lo); lo -= pad; hi += pad;
  function x(i) { return n === 1 ? L + (W - L - R) / 2 : L + (W - L - R) * i / (n - 1); }
  function y(v) { return T + (H - T - B) * (1 - (v - lo) / (hi - lo)); }
  var box = svg("svg", { viewBox: "0 0 " + W + " " + H, class: "chart", role: "img" });
  box.appendChild(svg("title", {}, "energy of every step (" + fmt(lo) + " to " + fmt(hi) + "); click to jump to a step"));
  var axes = svg("g", { class: "axes" });
  niceTicks(lo, hi, 4).forEach(function (v) {
    axes.appendChild(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }));
    axes.appendChild(svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end", class: "tick" }, fmt(v, Math.abs(hi - lo) < 2 ? 2 : 1)));
  });
  niceTicks(0, Math.max(1, n - 1), 8, true).forEach(function (i) {
    if (i > n - 1) return;
    axes.appendChild(svg("line", { x1: x(i), x2: x(i), y1: H - B, y2: H - B + 4, class: "axis" }));
    axes.appendChild(svg("text", { x: x(i), y: H - B + 16, "text-anchor": "middle", class: "tick" }, String(i)));
  });
  axes.appendChild(svg("line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" }));
  axes.appendChild(svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  axes.appendChild(svg("text", { x: (L + W - R) / 2, y: H - 2, "text-anchor": "middle", class: "label" }, "step"));
  axes.appendChild(svg("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle", class: "label",
    transform: "rotate(-90 12 " + (T + H - B) / 2 + ")" }, "energy"));
  box.appendChild(axes);
  var radius = n > 600 ? 1.6 : n > 120 ? 2.4 : 3.4, points = [];
  series.forEach(function (s, k) {
    var line = s.steps.map(function (st, i) { return st.e === null ? null : x(i).toFixed(1) + "," + y(st.e).toFixed(1); });
    box.appendChild(svg("polyline", { points: line.filter(Boolean).join(" "), class: "series s" + k, fill: "none" }));
    var dots = svg("g", { class: "points s" + k });
    s.steps.forEach(function (st, i) {
      if (st.e === null) return;
      var c = svg("circle", { cx: x(i).toFixed(1), cy: y(st.e).toFixed(1), r: radius, "data-step": i,
        class: st.real ? "real" : "shared" });
      c.appendChild(svg("title", {}, (s.name ? s.name + ": " : "") + "step " + i + " \u00b7 energy " + fmt(st.e) + " \u00b7 rank " + st.rank));
      dots.appendChild(c);
      points.push([c, st, k]);
    });
    box.appendChild(dots);
  });
  var marker = svg("line", { y1: T, y2: H - B, class: "marker" });
  box.appendChild(marker);
  function repaint() {
    points.forEach(function (p) {
      if (series.length > 1) return; // a diff's two series keep their own colours
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
    onPick(Math.max(0, Math.min(n - 1, Math.round(n === 1 ? 0 : (at.x - L) / (W - L - R) * (n - 1)))));
  });
  return { svg: box, repaint: repaint,
    mark: function (i) { marker.setAttribute("x1", x(i)); marker.setAttribute("x2", x(i)); } };
}
