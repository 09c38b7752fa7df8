// DOM helpers. Every string goes into the page as text (createTextNode, textContent,
// setAttribute), never as markup, so what a guest, an image or metadata says is shown,
// not run.

const SVG_NS = 'http://www.w3.org/2000/svg';

function build(el, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on') && typeof v === 'function') {
      el.addEventListener(k.slice(2), v);
    } else if (k === 'dataset') {
      for (const [dk, dv] of Object.entries(v)) el.dataset[dk] = String(dv);
    } else if (k === 'href' && !String(v).startsWith('#')) {
      throw new Error('only in-page links');
    } else {
      el.setAttribute(k, v === true ? '' : String(v));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else if (c instanceof Node) el.appendChild(c);
    else el.appendChild(document.createTextNode(String(c)));
  }
}

/** An HTML element: h('td', {class: 'x'}, 'text', child, ...). */
export function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** An SVG element. */
export function s(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

/** Replaces el's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export function bytes(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

export function duration(secs) {
  if (secs === null || secs === undefined || Number.isNaN(secs)) return '–';
  const neg = secs < 0;
  secs = Math.abs(Math.round(secs));
  const d = Math.floor(secs / 86400), hr = Math.floor(secs / 3600) % 24;
  const m = Math.floor(secs / 60) % 60, sec = secs % 60;
  let out;
  if (d) out = `${d}d ${hr}h`;
  else if (hr) out = `${hr}h ${m}m`;
  else if (m) out = `${m}m ${sec}s`;
  else out = `${sec}s`;
  return neg ? `-${out}` : out;
}

export function time(unixSecs) {
  return new Date(unixSecs * 1000).toLocaleTimeString([], {hour: '2-digit', minute: '2-digit', second: '2-digit'});
}

export function since(iso) {
  return (Date.now() - Date.parse(iso)) / 1000;
}

/** A labelled key/value list. */
export function facts(pairs) {
  return h('dl', {class: 'facts'}, pairs.map(([k, v]) => [h('dt', {}, k), h('dd', {}, v)]));
}
