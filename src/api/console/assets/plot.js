// Line charts in SVG, built with DOM calls (no markup strings). Each point is a circle,
// so a chart shows (and a test can count) the samples it plots.

import {h, s, time} from './dom.js';

const W = 640, H = 220, R = 12, T = 12, B = 28;
const COLORS = 8;
/** Width of one tick character in the viewBox (11px DejaVu Sans), for the left margin. */
const CHAR_W = 7;

/** A chart of series [{label, points: [[unixSecs, value], ...]}]; fmt formats values. */
export function chart(title, series, fmt = (v) => String(Math.round(v * 100) / 100)) {
  const all = series.flatMap((x) => x.points);
  const figure = h('figure', {class: 'chart'});
  figure.appendChild(h('figcaption', {}, title));
  if (all.length === 0) {
    figure.appendChild(h('p', {class: 'empty'}, 'No data yet.'));
    figure.dataset.points = '0';
    return figure;
  }
  let [t0, t1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  if (t1 === t0) { t0 -= 30; t1 += 30; }
  let v0 = Math.min(0, ...all.map((p) => p[1]));
  let v1 = Math.max(...all.map((p) => p[1]));
  if (v1 === v0) v1 = v0 + 1;
  // Ticks at the bottom, middle and top, each label once (a middle 0.5 of a count shows
  // as "1" twice otherwise); the left margin fits the longest label.
  const ticks = [];
  for (const v of [v0, v1, (v0 + v1) / 2]) {
    if (!ticks.some((t) => t.label === fmt(v))) ticks.push({v, label: fmt(v)});
  }
  const L = 10 + CHAR_W * Math.max(...ticks.map((t) => t.label.length));
  const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
  const y = (v) => H - B - ((v - v0) / (v1 - v0)) * (H - T - B);
  const svg = s('svg', {viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': `${title}: ${summary(series, fmt)}`});
  svg.appendChild(s('line', {class: 'axis', x1: L, y1: H - B, x2: W - R, y2: H - B}));
  svg.appendChild(s('line', {class: 'axis', x1: L, y1: T, x2: L, y2: H - B}));
  for (const {v, label} of ticks) {
    svg.appendChild(s('line', {class: 'grid', x1: L, y1: y(v), x2: W - R, y2: y(v)}));
    svg.appendChild(s('text', {class: 'tick', x: L - 4, y: y(v) + 4, 'text-anchor': 'end'}, label));
  }
  svg.appendChild(s('text', {class: 'tick', x: L, y: H - 8}, time(t0)));
  svg.appendChild(s('text', {class: 'tick', x: W - R, y: H - 8, 'text-anchor': 'end'}, time(t1)));
  let points = 0;
  series.forEach((ser, i) => {
    const cls = `series c${i % COLORS}`;
    const pts = ser.points.slice().sort((a, b) => a[0] - b[0]);
    if (pts.length > 1) {
      const d = pts.map((p, j) => `${j ? 'L' : 'M'}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(' ');
      svg.appendChild(s('path', {class: cls, d}));
    }
    for (const p of pts) {
      const c = s('circle', {class: `${cls} point`, cx: x(p[0]).toFixed(1), cy: y(p[1]).toFixed(1), r: pts.length > 120 ? 1 : 2.5});
      c.appendChild(s('title', {}, `${ser.label} ${time(p[0])}: ${fmt(p[1])}`));
      svg.appendChild(c);
      points++;
    }
  });
  figure.dataset.points = String(points);
  figure.appendChild(svg);
  figure.appendChild(h('ul', {class: 'legend'}, series.map((ser, i) => {
    const last = ser.points.length ? ser.points[ser.points.length - 1][1] : null;
    return h('li', {class: `c${i % COLORS}`}, h('span', {class: 'swatch', 'aria-hidden': 'true'}), `${ser.label}: ${last === null ? '–' : fmt(last)}`);
  })));
  return figure;
}

function summary(series, fmt) {
  return series.map((ser) => {
    const last = ser.points[ser.points.length - 1];
    return `${ser.label} ${last ? fmt(last[1]) : 'no data'} (${ser.points.length} points)`;
  }).join('; ');
}
