// A small VT100/xterm screen: the subset a login shell, readline, less, top and vi use
// (cursor moves, erases, scroll regions, insert/delete, SGR colours, the alternate
// screen, bracketed paste). Output is rendered as text nodes only.

import {h} from './dom.js';

const SCROLLBACK = 1000;

function blank(attr) {
  return {ch: ' ', a: attr};
}

export class Screen {
  /** el: the element rendered into; reply(text): answers to the host (cursor reports). */
  constructor(el, cols, rows, reply) {
    this.el = el;
    this.reply = reply;
    this.decoder = new TextDecoder('utf-8');
    this.history = h('div', {class: 'scrollback'});
    this.live = h('div', {class: 'screen'});
    el.append(this.history, this.live);
    this.attr = 0;
    this.fg = null; this.bg = null; this.bold = false; this.inverse = false;
    this.reset(cols, rows);
    this.pending = [];
    this.state = 'ground';
    this.params = '';
    this.appCursor = false;
    this.bracketedPaste = false;
    this.dirty = true;
  }

  reset(cols, rows) {
    this.cols = cols; this.rows = rows;
    this.grid = Array.from({length: rows}, () => this.row());
    this.x = 0; this.y = 0; this.wrapPending = false;
    this.top = 0; this.bottom = rows - 1;
    this.saved = {x: 0, y: 0};
    this.alt = null;
    this.cursorVisible = true;
  }

  row() {
    return Array.from({length: this.cols}, () => blank(this.style()));
  }

  style() {
    return {fg: this.fg, bg: this.bg, bold: this.bold, inverse: this.inverse};
  }

  resize(cols, rows) {
    if (cols === this.cols && rows === this.rows) return;
    const old = this.grid;
    this.cols = cols;
    // Rows that no longer fit go to the scrollback, as a terminal's do.
    while (old.length > rows && this.y > 0) { this.toHistory(old.shift()); this.y--; }
    old.length = Math.min(old.length, rows);
    this.grid = old.map((r) => {
      const n = r.slice(0, cols);
      while (n.length < cols) n.push(blank(this.style()));
      return n;
    });
    while (this.grid.length < rows) this.grid.push(this.row());
    this.rows = rows;
    this.top = 0; this.bottom = rows - 1;
    this.x = Math.min(this.x, cols - 1); this.y = Math.min(this.y, rows - 1);
    this.dirty = true;
  }

  write(bytes) {
    const text = this.decoder.decode(bytes, {stream: true});
    for (const ch of text) this.feed(ch);
    this.dirty = true;
  }

  feed(ch) {
    const c = ch.codePointAt(0);
    switch (this.state) {
      case 'ground':
        if (c === 0x1b) { this.state = 'esc'; return; }
        if (c < 0x20 || c === 0x7f) { this.control(c); return; }
        this.print(ch);
        return;
      case 'esc':
        this.state = 'ground';
        if (ch === '[') { this.state = 'csi'; this.params = ''; return; }
        if (ch === ']') { this.state = 'osc'; return; }
        if (ch === '(' || ch === ')' || ch === '#' || ch === '%') { this.state = 'skip'; return; }
        this.escape(ch);
        return;
      case 'skip':
        this.state = 'ground';
        return;
      case 'osc':
        // Titles and the like: ignored up to BEL or ST.
        if (c === 0x07) this.state = 'ground';
        else if (c === 0x1b) this.state = 'esc';
        return;
      case 'csi':
        if (c >= 0x40 && c <= 0x7e) { this.state = 'ground'; this.csi(ch, this.params); return; }
        if (this.params.length < 64) this.params += ch;
        return;
    }
  }

  control(c) {
    if (c === 0x0d) { this.x = 0; this.wrapPending = false; }
    else if (c === 0x0a || c === 0x0b || c === 0x0c) this.lineFeed();
    else if (c === 0x08) { if (this.x > 0) this.x--; this.wrapPending = false; }
    else if (c === 0x09) this.x = Math.min(this.cols - 1, (Math.floor(this.x / 8) + 1) * 8);
  }

  print(ch) {
    if (this.wrapPending) { this.x = 0; this.lineFeed(); this.wrapPending = false; }
    this.grid[this.y][this.x] = {ch, a: this.style()};
    if (this.x === this.cols - 1) this.wrapPending = true;
    else this.x++;
  }

  lineFeed() {
    if (this.y === this.bottom) this.scrollUp(1);
    else if (this.y < this.rows - 1) this.y++;
  }

  scrollUp(n) {
    for (let i = 0; i < n; i++) {
      const gone = this.grid.splice(this.top, 1)[0];
      if (this.top === 0 && !this.alt) this.toHistory(gone);
      this.grid.splice(this.bottom, 0, this.row());
    }
  }

  scrollDown(n) {
    for (let i = 0; i < n; i++) {
      this.grid.splice(this.bottom, 1);
      this.grid.splice(this.top, 0, this.row());
    }
  }

  /** Rows scrolled off the top wait here and are drawn at the next render, at most
   * SCROLLBACK of them, so a flood of lines costs no DOM work per line. */
  toHistory(row) {
    this.pending.push(row);
    if (this.pending.length > 2 * SCROLLBACK) this.pending.splice(0, this.pending.length - SCROLLBACK);
  }

  escape(ch) {
    if (ch === '7') this.saved = {x: this.x, y: this.y};
    else if (ch === '8') { this.x = this.saved.x; this.y = this.saved.y; }
    else if (ch === 'D') this.lineFeed();
    else if (ch === 'E') { this.x = 0; this.lineFeed(); }
    else if (ch === 'M') { if (this.y === this.top) this.scrollDown(1); else if (this.y > 0) this.y--; }
    else if (ch === 'c') this.reset(this.cols, this.rows);
  }

  csi(final, raw) {
    const priv = raw.startsWith('?');
    const args = (priv ? raw.slice(1) : raw).split(';').map((p) => parseInt(p, 10));
    const n = (i, d = 1) => (Number.isNaN(args[i]) || args[i] === undefined || args[i] === 0 ? d : args[i]);
    const clampX = (v) => Math.max(0, Math.min(this.cols - 1, v));
    const clampY = (v) => Math.max(0, Math.min(this.rows - 1, v));
    this.wrapPending = false;
    switch (final) {
      case 'A': this.y = Math.max(this.top, this.y - n(0)); break;
      case 'B': this.y = Math.min(this.bottom, this.y + n(0)); break;
      case 'C': this.x = clampX(this.x + n(0)); break;
      case 'D': this.x = clampX(this.x - n(0)); break;
      case 'E': this.x = 0; this.y = clampY(this.y + n(0)); break;
      case 'F': this.x = 0; this.y = clampY(this.y - n(0)); break;
      case 'G': case '`': this.x = clampX(n(0) - 1); break;
      case 'd': this.y = clampY(n(0) - 1); break;
      case 'H': case 'f': this.y = clampY(n(0) - 1); this.x = clampX(n(1) - 1); break;
      case 'J': this.eraseDisplay(Number.isNaN(args[0]) ? 0 : args[0]); break;
      case 'K': this.eraseLine(Number.isNaN(args[0]) ? 0 : args[0]); break;
      case 'L': if (this.y >= this.top && this.y <= this.bottom) this.insertLines(n(0)); break;
      case 'M': if (this.y >= this.top && this.y <= this.bottom) this.deleteLines(n(0)); break;
      case 'P': this.grid[this.y].splice(this.x, n(0)); this.pad(); break;
      case '@': for (let i = 0; i < n(0); i++) this.grid[this.y].splice(this.x, 0, blank(this.style())); this.grid[this.y].length = this.cols; break;
      case 'X': for (let i = 0; i < n(0) && this.x + i < this.cols; i++) this.grid[this.y][this.x + i] = blank(this.style()); break;
      case 'S': this.scrollUp(n(0)); break;
      case 'T': this.scrollDown(n(0)); break;
      case 'm': this.sgr(args); break;
      case 'r': this.top = clampY(n(0) - 1); this.bottom = clampY(n(1, this.rows) - 1); if (this.bottom <= this.top) { this.top = 0; this.bottom = this.rows - 1; } this.x = 0; this.y = this.top; break;
      case 's': this.saved = {x: this.x, y: this.y}; break;
      case 'u': this.x = this.saved.x; this.y = this.saved.y; break;
      case 'n': if (args[0] === 6) this.reply(`\x1b[${this.y + 1};${this.x + 1}R`); else if (args[0] === 5) this.reply('\x1b[0n'); break;
      case 'c': if (!priv && !raw.startsWith('>')) this.reply('\x1b[?1;2c'); break;
      case 'h': case 'l': if (priv) this.mode(args, final === 'h'); break;
      default: break;
    }
  }

  mode(args, on) {
    for (const m of args) {
      if (m === 1) this.appCursor = on;
      else if (m === 25) this.cursorVisible = on;
      else if (m === 2004) this.bracketedPaste = on;
      else if (m === 47 || m === 1047 || m === 1049) {
        if (on && !this.alt) {
          this.alt = {grid: this.grid, x: this.x, y: this.y};
          this.grid = Array.from({length: this.rows}, () => this.row());
          this.x = 0; this.y = 0;
        } else if (!on && this.alt) {
          const back = this.alt;
          this.alt = null;
          this.grid = back.grid.slice(0, this.rows);
          while (this.grid.length < this.rows) this.grid.push(this.row());
          for (const r of this.grid) { r.length = Math.min(r.length, this.cols); while (r.length < this.cols) r.push(blank(this.style())); }
          this.x = Math.min(back.x, this.cols - 1); this.y = Math.min(back.y, this.rows - 1);
        }
      }
    }
  }

  pad() {
    const r = this.grid[this.y];
    while (r.length < this.cols) r.push(blank(this.style()));
  }

  eraseDisplay(mode) {
    if (mode === 0) { this.eraseLine(0); for (let y = this.y + 1; y < this.rows; y++) this.grid[y] = this.row(); }
    else if (mode === 1) { this.eraseLine(1); for (let y = 0; y < this.y; y++) this.grid[y] = this.row(); }
    else if (mode === 2 || mode === 3) { for (let y = 0; y < this.rows; y++) this.grid[y] = this.row(); }
  }

  eraseLine(mode) {
    const r = this.grid[this.y];
    const [a, b] = mode === 0 ? [this.x, this.cols] : mode === 1 ? [0, this.x + 1] : [0, this.cols];
    for (let x = a; x < b; x++) r[x] = blank(this.style());
  }

  insertLines(n) {
    for (let i = 0; i < n; i++) { this.grid.splice(this.bottom, 1); this.grid.splice(this.y, 0, this.row()); }
  }

  deleteLines(n) {
    for (let i = 0; i < n; i++) { this.grid.splice(this.y, 1); this.grid.splice(this.bottom, 0, this.row()); }
  }

  sgr(args) {
    if (args.length === 0 || (args.length === 1 && Number.isNaN(args[0]))) args = [0];
    for (let i = 0; i < args.length; i++) {
      const p = Number.isNaN(args[i]) ? 0 : args[i];
      if (p === 0) { this.fg = null; this.bg = null; this.bold = false; this.inverse = false; }
      else if (p === 1) this.bold = true;
      else if (p === 22) this.bold = false;
      else if (p === 7) this.inverse = true;
      else if (p === 27) this.inverse = false;
      else if (p >= 30 && p <= 37) this.fg = p - 30;
      else if (p >= 90 && p <= 97) this.fg = p - 90 + 8;
      else if (p === 39) this.fg = null;
      else if (p >= 40 && p <= 47) this.bg = p - 40;
      else if (p >= 100 && p <= 107) this.bg = p - 100 + 8;
      else if (p === 49) this.bg = null;
      else if (p === 38 || p === 48) {
        // 256-colour and true colour: the first 16 map to the palette, others are dropped.
        let colour = null;
        if (args[i + 1] === 5) { colour = args[i + 2] < 16 ? args[i + 2] : null; i += 2; }
        else if (args[i + 1] === 2) { i += 4; }
        if (p === 38) this.fg = colour; else this.bg = colour;
      }
    }
  }

  renderRow(row, cursorX) {
    const line = h('div', {class: 'line'});
    let run = '', cls = null;
    const flush = () => {
      if (!run) return;
      line.appendChild(cls ? h('span', {class: cls}, run) : document.createTextNode(run));
      run = '';
    };
    row.forEach((cell, x) => {
      const a = cell.a;
      let fg = a.fg, bg = a.bg;
      if (a.inverse) [fg, bg] = [bg === null ? 'bg' : bg, fg === null ? 'fg' : fg];
      const parts = [];
      if (fg !== null) parts.push(`f${fg}`);
      if (bg !== null) parts.push(`b${bg}`);
      if (a.bold) parts.push('bold');
      if (x === cursorX) parts.push('cursor');
      const c = parts.length ? parts.join(' ') : null;
      if (c !== cls) { flush(); cls = c; }
      run += cell.ch;
    });
    flush();
    return line;
  }

  /** Redraws the live screen if anything changed. */
  render() {
    if (!this.dirty) return;
    this.dirty = false;
    if (this.pending.length) {
      const rows = this.pending.splice(0).slice(-SCROLLBACK).map((r) => this.renderRow(r, -1));
      this.history.append(...rows);
      while (this.history.childElementCount > SCROLLBACK) this.history.firstElementChild.remove();
    }
    const rows = this.grid.map((r, y) => this.renderRow(r, this.cursorVisible && y === this.y ? this.x : -1));
    this.live.replaceChildren(...rows);
  }

  /** The screen's text, one line per row (trailing spaces trimmed). */
  text() {
    return this.grid.map((r) => r.map((c) => c.ch).join('').trimEnd()).join('\n');
  }
}
