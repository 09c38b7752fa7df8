// A terminal into a running sandbox: a PTY through envd over a WebSocket
// (/console/terminal/<id>). The key goes as a subprotocol (a browser WebSocket cannot
// send headers). Leaving the page or closing the tab closes the socket, and the server
// kills the PTY.

import {h, fill} from './dom.js';
import {apiKey, onLeave} from './app.js';
import {Screen} from './vt.js';

const KEYS = {
  Enter: '\r', Backspace: '\x7f', Tab: '\t', Escape: '\x1b',
  Home: '\x1b[H', End: '\x1b[F', Insert: '\x1b[2~', Delete: '\x1b[3~',
  PageUp: '\x1b[5~', PageDown: '\x1b[6~',
  F1: '\x1bOP', F2: '\x1bOQ', F3: '\x1bOR', F4: '\x1bOS',
};
const ARROWS = {ArrowUp: 'A', ArrowDown: 'B', ArrowRight: 'C', ArrowLeft: 'D'};

export function mount(view, [id]) {
  const status = h('p', {class: 'term-status', role: 'status', 'aria-live': 'polite'}, 'Connecting…');
  const box = h('div', {class: 'term', id: 'terminal'});
  const input = h('textarea', {class: 'term-input', id: 'terminal-input', 'aria-label': 'Terminal input (Tab goes to the shell; Shift+Tab leaves)', autocapitalize: 'off', autocomplete: 'off', spellcheck: 'false'});
  const reconnect = h('button', {type: 'button', hidden: true, onclick: () => connect()}, 'Reconnect');
  const measure = h('span', {class: 'term-measure', 'aria-hidden': 'true'}, 'MMMMMMMMMM');
  view.append(
    h('p', {}, h('a', {href: `#/sandboxes/${id}`}, '← Sandbox ', h('span', {class: 'mono'}, id))),
    h('h1', {}, 'Terminal'), status, reconnect,
    h('div', {class: 'term-wrap'}, box, input, measure));

  let ws = null;
  let screen = null;
  let frame = 0;
  const size = () => {
    const cw = measure.getBoundingClientRect().width / 10 || 8;
    const ch = measure.getBoundingClientRect().height || 16;
    const cols = Math.max(20, Math.min(500, Math.floor((box.clientWidth - 8) / cw)));
    const rows = Math.max(5, Math.min(200, Math.floor((box.clientHeight - 8) / ch)));
    return [cols, rows];
  };
  const send = (text) => {
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({type: 'input', data: text}));
  };
  const draw = () => {
    frame = 0;
    screen.render();
    box.scrollTop = box.scrollHeight;
  };
  const connect = () => {
    reconnect.hidden = true;
    fill(box);
    const [cols, rows] = size();
    screen = new Screen(box, cols, rows, send);
    const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
    ws = new WebSocket(`${proto}//${location.host}/console/terminal/${id}?cols=${cols}&rows=${rows}`,
      ['agentenv.terminal', `agentenv.key.${apiKey()}`]);
    ws.binaryType = 'arraybuffer';
    ws.onopen = () => { fill(status, `Connected (${cols}×${rows}).`); input.focus(); };
    ws.onmessage = (e) => {
      if (typeof e.data === 'string') {
        const msg = JSON.parse(e.data);
        if (msg.type === 'exit') fill(status, `The shell ended (${msg.status}).`);
        else if (msg.type === 'error') fill(status, `Error: ${msg.message}`);
        return;
      }
      screen.write(new Uint8Array(e.data));
      if (!frame) frame = requestAnimationFrame(draw);
    };
    ws.onclose = () => {
      if (!status.textContent.startsWith('The shell ended') && !status.textContent.startsWith('Error')) {
        fill(status, 'Disconnected.');
      }
      reconnect.hidden = false;
    };
  };

  input.addEventListener('keydown', (e) => {
    if (e.key === 'Tab' && e.shiftKey) return; // leave the terminal
    let out = null;
    if (ARROWS[e.key]) out = (screen && screen.appCursor ? '\x1bO' : '\x1b[') + ARROWS[e.key];
    else if (KEYS[e.key]) out = KEYS[e.key];
    else if (e.ctrlKey && !e.altKey && e.key.length === 1) {
      const c = e.key.toUpperCase().charCodeAt(0);
      if (c >= 64 && c <= 95) out = String.fromCharCode(c - 64);
      else if (e.key === ' ') out = '\x00';
    } else if (e.altKey && e.key.length === 1) out = `\x1b${e.key}`;
    if (out !== null) {
      e.preventDefault();
      send(out);
    }
  });
  // Printable text (and IME, phone keyboards) arrives as input events.
  input.addEventListener('input', () => {
    if (input.value) { send(input.value); input.value = ''; }
  });
  input.addEventListener('paste', (e) => {
    e.preventDefault();
    const text = e.clipboardData.getData('text');
    send(screen && screen.bracketedPaste ? `\x1b[200~${text}\x1b[201~` : text);
  });
  box.addEventListener('click', () => input.focus());
  const observer = new ResizeObserver(() => {
    if (!screen) return;
    const [cols, rows] = size();
    if (cols === screen.cols && rows === screen.rows) return;
    screen.resize(cols, rows);
    if (!frame) frame = requestAnimationFrame(draw);
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({type: 'resize', cols, rows}));
  });
  observer.observe(box);
  onLeave(() => { observer.disconnect(); if (ws) ws.close(); });
  connect();
}
