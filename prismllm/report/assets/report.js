// prism report: draws the page's charts as SVG from the JSON blob in #report-data.
// Plain JavaScript, no library. Each draw* function fills one container and can be called again
// (on a resize, or another iteration chosen) to redraw it. The text of the page is written by
// prismllm/report/html.py; this script only adds the charts, their interaction, the iteration
// choice and the downloads (SVG, PNG and CSV, made in the page: nothing is fetched or sent).
(function () {
  'use strict';

  const D = JSON.parse(document.getElementById('report-data').textContent);
  const SVGNS = 'http://www.w3.org/2000/svg'; // a namespace name, never fetched

  // Okabe & Ito's palette (readable with every common kind of colour blindness).
  const OI = ['#0072B2', '#E69F00', '#56B4E9', '#009E73', '#D55E00', '#CC79A7', '#F0E442', '#999999'];
  const KIND = {
    compute: { color: '#0072B2', label: 'compute' },
    comm: { color: '#E69F00', label: 'communication' },
    wait: { color: '#CC79A7', label: 'waiting for the group\'s other members' },
  };
  const PARTS = [ // the per-rank breakdown, bottom to top
    { key: 'compute', color: '#0072B2', label: 'compute' },
    { key: 'comm', color: '#E69F00', label: 'communication not hidden by compute' },
    { key: 'p2p', color: '#CC79A7', label: 'waiting for a pipeline send/receive' },
    { key: 'idle', color: '#BBBBBB', label: 'other waiting' },
  ];

  // ------------------------------------------------------------------ formatting
  function fmtNs(ns) {
    if (ns == null || !isFinite(ns) || ns < 0) return '–';
    if (ns >= 1e9) return (ns / 1e9).toFixed(2) + ' s';
    if (ns >= 1e6) return (ns / 1e6).toFixed(2) + ' ms';
    if (ns >= 1e3) return (ns / 1e3).toFixed(1) + ' µs';
    return Math.round(ns) + ' ns';
  }
  function fmtBytes(b) {
    if (b == null || b < 0) return '–';
    if (b >= 2 ** 30) return (b / 2 ** 30).toFixed(2) + ' GiB';
    if (b >= 2 ** 20) return (b / 2 ** 20).toFixed(1) + ' MiB';
    return (b / 2 ** 10).toFixed(1) + ' KiB';
  }
  const pct = (x) => (100 * x).toFixed(1) + ' %';
  const num = (x) => x.toLocaleString('en-US');
  const measured = (b) => b != null && b >= 0; // bytes: -1 or null where not measured

  // ------------------------------------------------------------------ DOM helpers
  function svgEl(tag, attrs, parent) {
    const e = document.createElementNS(SVGNS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function text(parent, x, y, s, attrs) {
    const t = svgEl('text', Object.assign({ x: x, y: y }, attrs || {}), parent);
    t.textContent = s;
    return t;
  }
  // A fresh <svg> of the container's width (the viewBox keeps it scaling when printed).
  function newSvg(box, h) {
    box.textContent = '';
    const w = Math.max(box.clientWidth || 0, 600);
    const svg = svgEl('svg', { viewBox: `0 0 ${w} ${h}`, width: '100%', class: 'svg' }, box);
    svg.style.maxWidth = w + 'px';
    return { svg: svg, w: w };
  }
  function legend(box, items) {
    const div = document.createElement('div');
    div.className = 'legend';
    for (const it of items) {
      const s = document.createElement('span');
      const sw = document.createElement('i');
      sw.className = 'sw' + (it.cls ? ' ' + it.cls : '');
      sw.style.background = it.color;
      s.append(sw, it.label);
      div.appendChild(s);
    }
    box.appendChild(div);
  }

  // ------------------------------------------------------------------ tooltip
  // One tooltip for the page: any SVG element with data-tip shows it (lines split on \n);
  // the timeline sets its own through showTip. Text only (textContent), never HTML.
  const tip = document.getElementById('tip');
  function showTip(ev, s) {
    tip.textContent = s;
    tip.hidden = false;
    const r = tip.getBoundingClientRect();
    let x = ev.clientX + 14, y = ev.clientY + 14;
    if (x + r.width > window.innerWidth - 8) x = ev.clientX - r.width - 14;
    if (y + r.height > window.innerHeight - 8) y = ev.clientY - r.height - 14;
    tip.style.left = Math.max(4, x) + 'px';
    tip.style.top = Math.max(4, y) + 'px';
  }
  function hideTip() { tip.hidden = true; }
  document.addEventListener('mousemove', (ev) => {
    if (!(ev.target instanceof Element)) return;
    const t = ev.target.closest('[data-tip]');
    if (t) showTip(ev, t.getAttribute('data-tip'));
    else if (!ev.target.closest('#timeline-chart')) hideTip(); // the timeline keeps its own
  });

  // ------------------------------------------------------------------ layout coordinates
  // "pp 1 · tp 0 · dp 1" of a rank, the rule of prismllm/layout.py (mixed radix over `order`,
  // fastest first; its dp letter is the expert-data-parallel size edp).
  const L = D.layout;
  const ORDER = L ? (L.order || 'tp-cp-ep-dp-pp').split('-') : null;
  const SIZE = L ? { tp: L.tp || 1, cp: L.cp || 1, ep: L.ep || 1, dp: L.edp || L.dp || 1, pp: L.pp || 1 } : null;
  function coords(rank) {
    if (!L) return null;
    const c = {};
    let r = rank;
    for (const d of ORDER) { c[d] = r % SIZE[d]; r = Math.floor(r / SIZE[d]); }
    c.dp = ORDER.indexOf('ep') < ORDER.indexOf('dp') ? c.dp * SIZE.ep + c.ep : c.ep * SIZE.dp + c.dp;
    return c;
  }
  function where(rank) {
    const c = coords(rank);
    if (!c) return 'rank ' + rank;
    const size = { pp: L.pp, tp: L.tp, cp: L.cp, ep: L.ep, dp: L.edp || L.dp };
    const s = ['pp', 'tp', 'cp', 'ep', 'dp'].filter((d) => size[d] > 1).map((d) => d + ' ' + c[d]).join(' · ');
    return s || 'rank ' + rank;
  }

  // ------------------------------------------------------------------ the iteration shown
  // The timeline and the critical path show one iteration, the median at first; html.py writes
  // the text of each iteration in an element with data-iteration, and the chosen one's is shown.
  let shown = D.critical_path ? D.critical_path.iteration : null;
  const pathShown = () => D.critical_paths.find((cp) => cp.iteration === shown);
  function setIteration(k) {
    shown = k;
    document.querySelectorAll('[data-iteration]').forEach((e) => { e.hidden = Number(e.getAttribute('data-iteration')) !== k; });
    document.querySelectorAll('select.iteration').forEach((s) => { s.value = String(k); });
    tl = null; // the timeline starts again from the whole of the new iteration
    drawAll();
  }
  document.querySelectorAll('select.iteration').forEach((s) => s.addEventListener('change', () => setIteration(Number(s.value))));

  // ------------------------------------------------------------------ critical path
  function drawCritical(box) {
    const cp = pathShown();
    const kinds = Object.entries(cp.by_kind || {}).sort((a, b) => b[1] - a[1]);
    const total = cp.total_ns || kinds.reduce((s, k) => s + k[1], 0) || 1;
    // compute keeps its timeline colour; the others take the palette in order, the rest "other"
    const rest = OI.filter((c) => c !== KIND.compute.color);
    let i = 0;
    const items = [];
    let other = 0;
    for (const [k, v] of kinds) {
      if (k === 'compute') items.push({ k: k, v: v, color: KIND.compute.color });
      else if (i < rest.length - 1) items.push({ k: k, v: v, color: rest[i++] });
      else other += v;
    }
    if (other > 0) items.push({ k: 'other', v: other, color: rest[rest.length - 1] });
    const { svg, w } = newSvg(box, 46);
    let x = 0;
    for (const it of items) {
      const bw = (it.v / total) * w;
      svgEl('rect', { x: x, y: 4, width: Math.max(bw, 0.5), height: 30, fill: it.color, class: 'seg',
        'data-tip': `${it.k}\n${fmtNs(it.v)} · ${pct(it.v / total)} of the critical path` }, svg);
      if (bw > 60) text(svg, x + 6, 24, pct(it.v / total), { class: 'seg-label' });
      x += bw;
    }
    // the table: one row per kind, with the bar's colours
    const table = document.createElement('table');
    table.className = 'tbl compact';
    table.innerHTML = '<thead><tr><th>what</th><th class="num">time</th><th class="num">share</th></tr></thead>';
    const tb = document.createElement('tbody');
    for (const it of items) {
      const tr = document.createElement('tr');
      const td0 = document.createElement('td');
      const sw = document.createElement('i');
      sw.className = 'sw';
      sw.style.background = it.color;
      td0.append(sw, it.k);
      tr.appendChild(td0);
      for (const s of [fmtNs(it.v), pct(it.v / total)]) {
        const td = document.createElement('td');
        td.className = 'num';
        td.textContent = s;
        tr.appendChild(td);
      }
      tb.appendChild(tr);
    }
    table.appendChild(tb);
    box.appendChild(table);
  }

  // ------------------------------------------------------------------ per-rank breakdown
  function breakdownRows() {
    const b = D.breakdown;
    return b.ranks.map((r, i) => {
      const span = Math.max(b.span_ns[i] || 0, 0);
      const compute = Math.max(b.compute_ns[i] || 0, 0);
      const comm = Math.max(b.comm_exposed_ns[i] || 0, 0);
      const p2p = Math.max(b.p2p_wait_ns[i] || 0, 0);
      // P2P wait is part of the idle time (idle = span - compute - exposed communication)
      const idle = Math.max((b.idle_ns[i] || 0) - p2p, 0);
      return { rank: r, span: span, compute: compute, comm: comm, p2p: p2p, idle: idle };
    });
  }
  // Groups for a large job: per pipeline stage when there are a few, else runs of ranks.
  function groupRows(rows) {
    const groups = new Map();
    const byStage = L && L.pp > 1 && L.pp <= 64;
    const per = Math.ceil(rows.length / 64);
    for (const row of rows) {
      const key = byStage ? coords(row.rank).pp : Math.floor(row.rank / per);
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(row);
    }
    return [...groups.entries()].sort((a, b) => a[0] - b[0]).map(([key, rs]) => {
      const g = { label: byStage ? 'pp ' + key : `${rs[0].rank}–${rs[rs.length - 1].rank}`, n: rs.length,
        min: Infinity, max: 0 };
      for (const p of ['span', 'compute', 'comm', 'p2p', 'idle']) g[p] = rs.reduce((s, r) => s + r[p], 0) / rs.length;
      for (const r of rs) { g.min = Math.min(g.min, r.span); g.max = Math.max(g.max, r.span); }
      return g;
    });
  }
  function drawBreakdown(box) {
    const rows = breakdownRows();
    const big = rows.length > 64;
    const cols = big ? groupRows(rows) : rows;
    const H = 240, top = 12, bottom = 40, left = 64;
    const { svg, w } = newSvg(box, H + (big ? 70 : 0));
    const plotW = w - left - 8, plotH = H - top - bottom;
    const ymax = Math.max(...cols.map((c) => (big ? c.max : c.span)), 1);
    const y = (v) => top + plotH - (v / ymax) * plotH;
    // y axis: a few ticks in ms
    for (const t of ticks(0, ymax, 5)) {
      svgEl('line', { x1: left, x2: w - 8, y1: y(t), y2: y(t), class: 'grid' }, svg);
      text(svg, left - 6, y(t) + 4, fmtMs(t, ymax / 5), { class: 'tick', 'text-anchor': 'end' });
    }
    text(svg, 12, top + plotH / 2, 'ms', { class: 'axis-label', transform: `rotate(-90 12 ${top + plotH / 2})` });
    const slot = plotW / cols.length, bw = Math.min(56, slot * 0.72);
    const longest = Math.max(...cols.map((c) => (big ? c.label : String(c.rank)).length));
    const labelEvery = Math.ceil(cols.length / Math.floor(plotW / (longest * 7 + 14)));
    cols.forEach((c, i) => {
      const x = left + i * slot + (slot - bw) / 2;
      const g = svgEl('g', { class: 'col' }, svg);
      const head = big ? `${c.label} (${num(c.n)} ranks), mean of the group` : `rank ${c.rank} (${where(c.rank)})`;
      const lines = PARTS.map((p) => `${p.label}: ${fmtNs(c[p.key])} (${pct(c[p.key] / (c.span || 1))})`);
      const tail = big ? `iteration: ${fmtNs(c.min)} – ${fmtNs(c.max)} (mean ${fmtNs(c.span)})`
        : `iteration: ${fmtNs(c.span)}`;
      g.setAttribute('data-tip', [head, ...lines, tail].join('\n'));
      let acc = 0;
      for (const p of PARTS) {
        const v = c[p.key];
        if (v <= 0) continue;
        svgEl('rect', { x: x, y: y(acc + v), width: bw, height: Math.max(y(acc) - y(acc + v), 0.5), fill: p.color }, g);
        acc += v;
      }
      svgEl('rect', { x: left + i * slot, y: top, width: slot, height: plotH, fill: 'transparent' }, g);
      if (big) { // whisker: the group's shortest to longest iteration
        const cx = x + bw / 2;
        svgEl('path', { d: `M${cx} ${y(c.min)}V${y(c.max)}M${cx - 5} ${y(c.max)}h10M${cx - 5} ${y(c.min)}h10`,
          class: 'whisker' }, g);
      }
      if (i % labelEvery === 0) {
        text(svg, left + i * slot + slot / 2, H - bottom + 16, big ? c.label : String(c.rank),
          { class: 'tick', 'text-anchor': 'middle' });
      }
    });
    text(svg, left + plotW / 2, H - 6, big ? (L && L.pp > 1 ? 'pipeline stage' : 'ranks') : 'rank',
      { class: 'axis-label', 'text-anchor': 'middle' });
    if (big) heatStrip(svg, rows, left, H + 8, plotW);
    legend(box, PARTS);
  }
  // One thin cell per rank: its busy share (compute + communication not hidden) of its iteration;
  // past STRIP_CELLS ranks a cell is a run of consecutive ranks, coloured by their mean share
  // (131,072 cells of a hundredth of a pixel took 1.3 s to make and showed nothing more).
  const STRIP_CELLS = 2048;
  function heatStrip(svg, rows, x0, y0, width) {
    const per = Math.ceil(rows.length / STRIP_CELLS), cells = Math.ceil(rows.length / per);
    const label = per === 1 ? 'busy share of every rank, in rank order'
      : `busy share in rank order (a cell: the mean of ${num(per)} ranks)`;
    text(svg, x0, y0 + 8, label, { class: 'tick' });
    const cw = width / cells, h = 22, y = y0 + 14;
    const g = svgEl('g', {}, svg);
    let stage = null;
    for (let c = 0; c < cells; c++) {
      const rs = rows.slice(c * per, (c + 1) * per);
      const shares = rs.map((r) => (r.compute + r.comm) / (r.span || 1));
      const busy = shares.reduce((a, b) => a + b, 0) / shares.length;
      const first = rs[0].rank, last = rs[rs.length - 1].rank;
      const tipText = per === 1 ? `rank ${first} (${where(first)})\nbusy ${pct(busy)} of ${fmtNs(rs[0].span)}`
        : `ranks ${first}–${last} (${where(first)} to ${where(last)})\nbusy ${pct(busy)} on average, ` +
          `${pct(Math.min(...shares))} – ${pct(Math.max(...shares))}`;
      svgEl('rect', { x: x0 + c * cw, y: y, width: cw + 0.3, height: h, fill: seqColor(busy, BLUES), 'data-tip': tipText }, g);
      if (L && L.pp > 1) { // a tick where a pipeline stage begins
        const s = coords(first).pp;
        if (stage !== null && s !== stage) svgEl('line', { x1: x0 + c * cw, x2: x0 + c * cw, y1: y - 3, y2: y + h + 3, class: 'sep' }, svg);
        stage = s;
      }
    }
    text(svg, x0 + width, y0 + 8, 'light: mostly waiting · dark: mostly busy', { class: 'tick', 'text-anchor': 'end' });
  }

  // ------------------------------------------------------------------ colour scales
  const YLORBR = ['#fff7bc', '#fee391', '#fec44f', '#fe9929', '#ec7014', '#cc4c02', '#8c2d04'];
  const BLUES = ['#f7fbff', '#c6dbef', '#9ecae1', '#6baed6', '#3182bd', '#08519c'];
  function seqColor(t, stops) {
    t = Math.min(Math.max(isFinite(t) ? t : 0, 0), 1) * (stops.length - 1);
    const i = Math.min(Math.floor(t), stops.length - 2), f = t - i;
    const a = hex(stops[i]), b = hex(stops[i + 1]);
    return `rgb(${a.map((v, k) => Math.round(v + (b[k] - v) * f)).join(',')})`;
  }
  const hex = (s) => [1, 3, 5].map((i) => parseInt(s.slice(i, i + 2), 16));
  function darkText(rgb) { // pick black or white text for a background colour
    const [r, g, b] = rgb.match(/\d+/g).map(Number);
    return 0.299 * r + 0.587 * g + 0.114 * b > 140;
  }

  // ------------------------------------------------------------------ memory heat map
  // a grid column's name; data without col_labels (older reports) has tp columns
  const gridColumn = (j) => (D.memory.grid.col_labels ? D.memory.grid.col_labels[j] : `tp ${j}`);
  function drawMemory(box) {
    const m = D.memory;
    // the grid (pp x the model-parallel coordinates ep, cp, tp), or without a layout the ranks in
    // rows of 32
    const per = 32;
    const values = m.grid ? m.grid.values : Array.from({ length: Math.ceil(m.per_rank.length / per) },
      (_, i) => m.per_rank.slice(i * per, (i + 1) * per));
    const colName = (j) => (m.grid ? gridColumn(j) : `+${j}`);
    const cellName = (i, j) => (m.grid ? `pp ${i} · ${colName(j)}` : `rank ${i * per + j}`);
    const nr = values.length, nc = Math.max(...values.map((r) => r.length));
    const known = values.flat().filter(measured);
    const lo = Math.min(...known), hi = Math.max(...known);
    const left = 56, top = 24, legendW = 150;
    const avail = Math.max(box.clientWidth || 0, 600) - left - legendW - 40;
    const cw = Math.max(Math.min(avail / nc, 110), 8), ch = Math.max(Math.min(cw * 0.45, 40), 14);
    const { svg, w } = newSvg(box, top + nr * ch + 30);
    svg.style.maxWidth = w + 'px';
    const maxRank = m.max ? m.max.rank : null;
    let maxCell = null;
    values.forEach((row, i) => {
      text(svg, left - 8, top + i * ch + ch / 2 + 4, m.grid ? `pp ${i}` : `${i * per}+`, { class: 'tick', 'text-anchor': 'end' });
      row.forEach((v, j) => {
        const x = left + j * cw, yy = top + i * ch;
        const ok = measured(v);
        const fill = ok ? seqColor(hi > lo ? (v - lo) / (hi - lo) : 1, YLORBR) : '#eeeeee';
        const label = cellName(i, j);
        svgEl('rect', { x: x, y: yy, width: cw - 1, height: ch - 1, fill: fill, class: 'cell',
          'data-tip': ok ? `${label}\n${fmtBytes(v)}\n${num(v)} bytes` : `${label}\nnot measured` }, svg);
        if (cw >= 64) {
          text(svg, x + cw / 2, yy + ch / 2 + 4, ok ? fmtBytes(v) : '?',
            { class: 'cell-label', 'text-anchor': 'middle', style: `fill:${darkText(fill) || !ok ? '#222' : '#fff'}` });
        }
        if (ok && v === hi && maxCell === null) maxCell = [x, yy];
      });
    });
    // a tick on every k-th column: at most 32, and each label its width (about 6.5 px a character
    // at the ticks' 11.5 px; "ep 7 · tp 1" is ~70 px) plus a gap, so none overlap
    let longest = 0;
    for (let j = 0; j < nc; j++) longest = Math.max(longest, String(colName(j)).length);
    let every = Math.max(Math.ceil(nc / 32), Math.ceil((longest * 6.5 + 8) / cw), 1);
    // thinned, round up to a multiple of a slower dimension's stride: "ep 0 · tp 0", "ep 4 · tp 0", ...
    if (every > 1 && m.grid && m.grid.cols && D.layout) {
      let stride = 1, step = 1;
      for (const d of m.grid.cols.split(' · ').reverse()) {
        if (stride <= every) step = stride;
        stride *= D.layout[d] || 1;
      }
      every = Math.ceil(every / step) * step;
    }
    const half = (longest * 6.5) / 2; // keep the first label inside the picture
    for (let j = 0; j < nc; j += every) {
      text(svg, Math.max(left + j * cw + cw / 2, half + 2), top - 8, colName(j), { class: 'tick col-tick', 'text-anchor': 'middle' });
    }
    if (maxCell) svgEl('rect', { x: maxCell[0] - 1, y: maxCell[1] - 1, width: cw + 1, height: ch + 1, class: 'max-cell' }, svg);
    // legend: the colour ramp from the least to the most memory
    const lx = left + nc * cw + 30, ly = top;
    const grad = svgEl('linearGradient', { id: 'mem-grad', x1: 0, x2: 0, y1: 1, y2: 0 }, svgEl('defs', {}, svg));
    YLORBR.forEach((c, i) => svgEl('stop', { offset: i / (YLORBR.length - 1), 'stop-color': c }, grad));
    const lh = Math.max(nr * ch, 60);
    svgEl('rect', { x: lx, y: ly, width: 14, height: lh, fill: 'url(#mem-grad)', class: 'ramp' }, svg);
    text(svg, lx + 20, ly + 10, fmtBytes(hi) + ' (most)', { class: 'tick' });
    text(svg, lx + 20, ly + lh, fmtBytes(lo) + ' (least)', { class: 'tick' });
    svg.setAttribute('viewBox', `0 0 ${w} ${top + Math.max(nr * ch, lh) + 12}`);
    if (maxRank != null) {
      const p = document.createElement('p');
      p.className = 'note';
      p.textContent = `Largest: ${fmtBytes(m.max.bytes)} (${num(m.max.bytes)} bytes) on rank ${maxRank} (${m.max.where}).`;
      box.appendChild(p);
    }
  }

  // ------------------------------------------------------------------ peak memory rank by rank
  // The run keeps one peak per rank and source, not memory over time: a line per source in rank
  // order (the emulation's few ranks as dots: a line would make up the ranks between), the rank
  // chosen marked and its figures written beside the chooser.
  function memorySources() {
    const n = D.memory.per_rank.length;
    const out = [{ label: 'solo capture', color: OI[0], v: D.memory.per_rank }];
    const emu = new Array(n).fill(-1), real = new Array(n).fill(-1);
    for (const [r, m] of Object.entries((D.emulation && D.emulation.per_rank) || {})) {
      if (measured(m.peak_memory_bytes) && Number(r) < n) emu[Number(r)] = m.peak_memory_bytes;
    }
    for (const x of (D.reference && D.reference.per_rank) || []) if (measured(x.real_bytes) && x.rank < n) real[x.rank] = x.real_bytes;
    if (emu.some(measured)) out.push({ label: 'emulation (run for real)', color: OI[4], v: emu, dots: true });
    if (real.some(measured)) out.push({ label: 'real run', color: OI[3], v: real });
    return out;
  }
  const memInput = document.getElementById('memory-rank');
  function chosenRank(n) {
    const r = Math.round(Number(memInput.value));
    return Math.min(Math.max(isFinite(r) ? r : 0, 0), n - 1);
  }
  function drawMemoryRanks(box) {
    const src = memorySources(), n = D.memory.per_rank.length;
    const H = 220, top = 12, bottom = 34, left = 72;
    const { svg, w } = newSvg(box, H);
    const plotW = w - left - 16, plotH = H - top - bottom;
    // the axis spans the figures (ranks differ by a few per cent), in the unit of the largest
    const all = src.flatMap((s) => s.v.filter(measured));
    const lo = all.reduce((m, b) => Math.min(m, b), Infinity), hi = all.reduce((m, b) => Math.max(m, b), 1);
    const pad = (hi - lo) * 0.15 || hi * 0.05;
    const [unit, uname] = hi >= 2 ** 30 ? [2 ** 30, 'GiB'] : hi >= 2 ** 20 ? [2 ** 20, 'MiB'] : [2 ** 10, 'KiB'];
    const y0 = Math.max(lo - pad, 0) / unit, y1 = (hi + pad) / unit;
    const X = (r) => left + (n > 1 ? (r / (n - 1)) * plotW : plotW / 2);
    const Y = (b) => top + plotH - ((b / unit - y0) / (y1 - y0)) * plotH;
    const yt = ticks(y0, y1, 4);
    const digits = Math.max(0, -Math.floor(Math.log10(yt.length > 1 ? yt[1] - yt[0] : 1) + 1e-9));
    for (const t of yt) {
      svgEl('line', { x1: left, x2: left + plotW, y1: Y(t * unit), y2: Y(t * unit), class: 'grid' }, svg);
      text(svg, left - 6, Y(t * unit) + 4, `${t.toFixed(digits)} ${uname}`, { class: 'tick', 'text-anchor': 'end' });
    }
    for (const t of ticks(0, n - 1, Math.min(8, Math.max(n - 1, 1)))) {
      if (Number.isInteger(t)) text(svg, X(t), top + plotH + 16, String(t), { class: 'tick', 'text-anchor': 'middle' });
    }
    text(svg, left + plotW / 2, H - 4, 'rank', { class: 'axis-label', 'text-anchor': 'middle' });
    for (const s of src) {
      if (s.dots) {
        s.v.forEach((b, r) => measured(b) && svgEl('circle', { cx: X(r), cy: Y(b), r: 3.5, fill: s.color }, svg));
        continue;
      }
      let d = '', pen = false; // a rank without a figure breaks the line
      s.v.forEach((b, r) => {
        if (measured(b)) d += (pen ? 'L' : 'M') + X(r).toFixed(1) + ' ' + Y(b).toFixed(1);
        pen = measured(b);
      });
      svgEl('path', { d: d, stroke: s.color, class: 'mem-line' }, svg);
    }
    const r = chosenRank(n);
    svgEl('line', { x1: X(r), x2: X(r), y1: top, y2: top + plotH, class: 'mem-marker' }, svg);
    for (const s of src) if (measured(s.v[r])) svgEl('circle', { cx: X(r), cy: Y(s.v[r]), r: 5, fill: s.color, class: 'mem-at' }, svg);
    legend(box, src);
    document.querySelector('#memory .memory-rank-text').textContent =
      `rank ${r} (${where(r)}): ` + src.map((s) => `${s.label} ${fmtBytes(s.v[r])}`).join(' · ');
  }
  if (memInput) memInput.addEventListener('input', () => drawMemoryRanks(document.getElementById('memory-ranks-chart')));

  // ------------------------------------------------------------------ axis helpers
  function niceStep(range, n) {
    const raw = range / Math.max(n, 1), p = 10 ** Math.floor(Math.log10(raw)), f = raw / p;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * p;
  }
  function ticks(a, b, n) {
    const s = niceStep(b - a, n), out = [];
    for (let t = Math.ceil(a / s) * s; t <= b + s * 1e-9; t += s) out.push(t);
    return out;
  }
  function fmtMs(ns, step) { // a tick label in ms, with as many decimals as the step needs
    const d = Math.max(0, Math.min(6, -Math.floor(Math.log10(step / 1e6) + 1e-9)));
    return (ns / 1e6).toFixed(d);
  }

  // ------------------------------------------------------------------ timeline
  // Spans are drawn as one <path> per (lane, kind): a few elements whatever the span count.
  // Spans closer than half a pixel merge into one rectangle, so the zoomed-out view stays light.
  const TL = { rowH: 44, laneY: [0, 20], laneH: [17, 10], critY: 32, critH: 4, left: 150, top: 28 };
  let tl = null; // the timeline's state: spans per row and lane, the view, the svg parts
  let tlBound = false; // the timeline's listeners, bound once (its state is made again for each iteration)
  const timelineShown = () => D.timeline.iterations.find((x) => x.iteration === shown);
  function prepTimeline() {
    const T = timelineShown();
    const kinds = Object.keys(KIND);
    const rows = D.timeline.ranks.map((r, i) => {
      const lanes = [0, 1].map((l) => {
        const sp = T.spans[i].filter((s) => s[0] === l).sort((a, b) => a[2] - b[2]);
        return { a: Float64Array.from(sp, (s) => s[2]), b: Float64Array.from(sp, (s) => s[3]),
          k: Uint8Array.from(sp, (s) => Math.max(kinds.indexOf(s[1]), 0)), c: Uint8Array.from(sp, (s) => s[5] ? 1 : 0),
          s: sp };
      });
      return { rank: r.rank, label: r.label, lanes: lanes };
    });
    const end = T.spans.reduce((m, spans) => spans.reduce((mm, sp) => Math.max(mm, sp[3]), m), Math.max(T.end_ns || 0, 1));
    return { rows: rows, kinds: kinds, end: end, t0: 0, t1: end };
  }
  function drawTimeline(box) {
    if (!tl) tl = prepTimeline();
    const h = TL.top + tl.rows.length * TL.rowH + 24;
    const { svg, w } = newSvg(box, h);
    tl.svg = svg; tl.w = w; tl.h = h;
    const plot = { x: TL.left, w: w - TL.left - 12 };
    tl.plot = plot;
    const clip = svgEl('clipPath', { id: 'tl-clip' }, svgEl('defs', {}, svg));
    svgEl('rect', { x: plot.x, y: 0, width: plot.w, height: h }, clip);
    tl.axis = svgEl('g', { class: 'axis' }, svg);
    tl.rows.forEach((r, i) => {
      const y = TL.top + i * TL.rowH;
      text(svg, 8, y + 13, 'rank ' + r.rank, { class: 'row-label' });
      text(svg, 8, y + 27, r.label || '', { class: 'row-sub' });
      svgEl('rect', { x: plot.x, y: y + TL.laneY[1], width: plot.w, height: TL.laneH[1], class: 'lane-bg' }, svg);
    });
    const g = svgEl('g', { 'clip-path': 'url(#tl-clip)' }, svg);
    tl.paths = [];
    for (const lane of [0, 1]) {
      tl.kinds.forEach((k, ki) => {
        tl.paths.push({ lane: lane, kind: ki, el: svgEl('path', { fill: KIND[k].color, class: `span k-${k} lane-${lane}` }, g) });
      });
    }
    tl.crit = svgEl('path', { class: 'crit' }, g);
    tl.hover = svgEl('rect', { class: 'hover', visibility: 'hidden' }, g);
    legend(box, [...Object.values(KIND), { color: '#111', label: 'on the critical path (the tick under the lanes)', cls: 'flat' }]);
    renderTimeline();
    if (!tlBound) bindTimeline(box);
  }
  // Redraw the spans and the axis for the view [t0, t1]. Each lane is binned into pixel columns:
  // a column takes the kind that covers most of it, and runs of one kind become one rectangle, so
  // the path stays small however many spans there are, and no kind hides another by draw order.
  function renderTimeline() {
    const { plot, t0, t1 } = tl;
    const sc = plot.w / (t1 - t0);
    const X = (t) => plot.x + (t - t0) * sc;
    const nk = tl.kinds.length, npx = Math.ceil(plot.w);
    const cov = new Float32Array(npx * nk), cc = new Float32Array(npx);
    const d = tl.paths.map(() => []), crit = [];
    const rect = (out, x, w, y, h) => out.push(`M${(plot.x + x).toFixed(1)} ${y}h${w}v${h}h${-w}z`);
    tl.rows.forEach((r, i) => {
      const y0 = TL.top + i * TL.rowH;
      r.lanes.forEach((ln, lane) => {
        cov.fill(0);
        cc.fill(0);
        for (let j = 0; j < ln.a.length; j++) { // coverage of each pixel column by each kind
          if (ln.b[j] < t0 || ln.a[j] > t1) continue;
          const x1 = (Math.max(ln.a[j], t0) - t0) * sc, x2 = Math.max((Math.min(ln.b[j], t1) - t0) * sc, x1 + 1e-3);
          for (let p = Math.max(Math.floor(x1), 0), e = Math.min(Math.ceil(x2), npx); p < e; p++) {
            const c = Math.min(x2, p + 1) - Math.max(x1, p);
            cov[p * nk + ln.k[j]] += c;
            if (ln.c[j]) cc[p] += c;
          }
        }
        let run = -1, from = 0, critFrom = -1;
        for (let p = 0; p <= npx; p++) {
          let best = -1, bv = 0;
          for (let k = 0; p < npx && k < nk; k++) if (cov[p * nk + k] > bv) { bv = cov[p * nk + k]; best = k; }
          if (best !== run) { // a run of one kind ends here
            if (run >= 0) rect(d[lane * nk + run], from, p - from, y0 + TL.laneY[lane], TL.laneH[lane]);
            run = best;
            from = p;
          }
          const isCrit = p < npx && cc[p] > 0;
          if (isCrit && critFrom < 0) critFrom = p;
          if (!isCrit && critFrom >= 0) { rect(crit, critFrom, p - critFrom, y0 + TL.critY, TL.critH); critFrom = -1; }
        }
      });
    });
    tl.paths.forEach((p, i) => p.el.setAttribute('d', d[i].join('')));
    tl.crit.setAttribute('d', crit.join(''));
    // axis: ticks in ms across the rows
    tl.axis.textContent = '';
    const step = niceStep(t1 - t0, Math.max(Math.floor(plot.w / 90), 2));
    const bottom = TL.top + tl.rows.length * TL.rowH - 6;
    let grid = '';
    for (const t of ticks(t0, t1, Math.max(Math.floor(plot.w / 90), 2))) {
      const x = X(t).toFixed(1);
      grid += `M${x} ${TL.top - 6}V${bottom}`;
      text(tl.axis, x, TL.top - 10, fmtMs(t, step), { class: 'tick', 'text-anchor': 'middle' });
    }
    svgEl('path', { d: grid, class: 'grid' }, tl.axis);
    text(tl.axis, plot.x + plot.w, tl.h - 6, 'ms from the start of the iteration', { class: 'axis-label', 'text-anchor': 'end' });
    const vt = document.querySelector('#timeline .view-text');
    if (vt) vt.textContent = `showing ${fmtMs(t0, step)}–${fmtMs(t1, step)} ms of ${fmtNs(tl.end)}`;
  }
  let pending = false;
  function redraw() { // at most one redraw per animation frame
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; renderTimeline(); });
  }
  function zoom(factor, at) { // factor < 1 zooms in around time `at`
    const span = Math.min(Math.max((tl.t1 - tl.t0) * factor, 1000), tl.end);
    const f = (at - tl.t0) / (tl.t1 - tl.t0);
    setView(at - f * span, span);
  }
  function setView(t0, span) {
    t0 = Math.min(Math.max(t0, 0), tl.end - span);
    tl.t0 = t0; tl.t1 = t0 + span;
    redraw();
  }
  // Pointer position in the svg's own units (it may be scaled by the page).
  function svgPoint(ev) {
    const r = tl.svg.getBoundingClientRect();
    return [(ev.clientX - r.left) * tl.w / r.width, (ev.clientY - r.top) * tl.h / r.height];
  }
  const timeAt = (x) => tl.t0 + (x - tl.plot.x) * (tl.t1 - tl.t0) / tl.plot.w;
  // The span under the pointer: the shortest one that holds it, else the nearest within 3 px.
  function spanAt(x, y) {
    const i = Math.floor((y - TL.top) / TL.rowH);
    if (i < 0 || i >= tl.rows.length || x < tl.plot.x) return null;
    const dy = y - TL.top - i * TL.rowH;
    const lane = dy < TL.laneY[1] - 1 ? 0 : dy < TL.laneY[1] + TL.laneH[1] + 1 ? 1 : -1;
    if (lane < 0) return null;
    const ln = tl.rows[i].lanes[lane], t = timeAt(x), tol = 3 * (tl.t1 - tl.t0) / tl.plot.w;
    let best = -1, bestD = Infinity;
    for (let j = 0; j < ln.a.length; j++) {
      if (ln.a[j] > t + tol) break;
      const dist = t < ln.a[j] ? ln.a[j] - t : t > ln.b[j] ? t - ln.b[j] : -1 / (1 + ln.b[j] - ln.a[j]);
      if (dist <= tol && dist < bestD) { bestD = dist; best = j; }
    }
    return best < 0 ? null : { row: i, lane: lane, span: ln.s[best] };
  }
  function bindTimeline(box) {
    tlBound = true;
    let drag = null;
    box.addEventListener('wheel', (ev) => {
      if (!tl.svg.contains(ev.target)) return;
      ev.preventDefault();
      const [x] = svgPoint(ev);
      zoom(Math.exp((ev.deltaY || ev.deltaX) * 0.0015), timeAt(Math.max(x, tl.plot.x)));
    }, { passive: false });
    box.addEventListener('pointerdown', (ev) => {
      if (ev.button !== 0) return;
      drag = { x: svgPoint(ev)[0], t0: tl.t0 };
      box.setPointerCapture(ev.pointerId);
      box.classList.add('dragging');
    });
    box.addEventListener('pointerup', (ev) => { drag = null; box.classList.remove('dragging'); box.releasePointerCapture(ev.pointerId); });
    box.addEventListener('pointermove', (ev) => {
      const [x, y] = svgPoint(ev);
      if (drag) {
        hideTip();
        setView(drag.t0 - (x - drag.x) * (tl.t1 - tl.t0) / tl.plot.w, tl.t1 - tl.t0);
        return;
      }
      const hit = spanAt(x, y);
      if (!hit) { hideTip(); tl.hover.setAttribute('visibility', 'hidden'); return; }
      const [, kind, a, b, name, c] = hit.span;
      showTip(ev, `${name}\n${KIND[kind] ? KIND[kind].label : kind} · ${fmtNs(b - a)}\n` +
        `${(a / 1e6).toFixed(3)}–${(b / 1e6).toFixed(3)} ms, rank ${tl.rows[hit.row].rank}, ` +
        `${hit.lane ? 'background communication' : 'program'}` + (c ? '\non the critical path' : ''));
      const sc = tl.plot.w / (tl.t1 - tl.t0);
      const x0 = tl.plot.x + (a - tl.t0) * sc;
      Object.entries({ x: x0 - 1, y: TL.top + hit.row * TL.rowH + TL.laneY[hit.lane] - 1,
        width: Math.max((b - a) * sc, 1) + 2, height: TL.laneH[hit.lane] + 2, visibility: 'visible' })
        .forEach(([k, v]) => tl.hover.setAttribute(k, v));
    });
    box.addEventListener('pointerleave', () => { hideTip(); tl.hover.setAttribute('visibility', 'hidden'); });
    document.querySelectorAll('#timeline [data-zoom]').forEach((btn) => btn.addEventListener('click', () => {
      const mid = (tl.t0 + tl.t1) / 2, z = btn.getAttribute('data-zoom');
      if (z === 'reset') setView(0, tl.end);
      else zoom(z === 'in' ? 0.5 : 2, mid);
    }));
  }

  // ------------------------------------------------------------------ communicators
  function commParts() {
    const c = D.communicators;
    return [
      { v: c.all_real, color: '#0072B2', label: 'real communicator of sandbox ranks only' },
      { v: c.pruned, color: '#E69F00', label: 'sandbox ranks plus one stand-in' },
      { v: c.not_instantiated, color: '#DDDDDD', label: 'never created (no sandbox rank in it)' },
    ];
  }
  function drawCommunicators(box) {
    const c = D.communicators, parts = commParts();
    const total = c.logical_groups || parts.reduce((s, p) => s + p.v, 0) || 1;
    const { svg, w } = newSvg(box, 34);
    let x = 0;
    for (const p of parts) {
      const bw = (p.v / total) * w;
      if (bw <= 0) continue;
      svgEl('rect', { x: x, y: 2, width: bw, height: 26, fill: p.color, class: 'seg',
        'data-tip': `${p.label}\n${num(p.v)} of ${num(total)} process groups` }, svg);
      if (bw > 30) text(svg, x + 6, 20, num(p.v), { class: 'seg-label' + (p.color === '#DDDDDD' ? ' dark' : '') });
      x += bw;
    }
    legend(box, parts.map((p) => ({ color: p.color, label: `${p.label}: ${num(p.v)}` })));
  }

  // ------------------------------------------------------------------ downloads
  // Each heading with data-dl gets small buttons: a chart's picture as SVG or PNG and the data
  // behind it as CSV, a table as CSV. The files are made here and handed to the browser.
  const criticalCsv = () => {
    const cp = pathShown();
    return [['iteration', 'what', 'ns', 'share of the path'],
      ...Object.entries(cp.by_kind).map(([k, v]) => [cp.iteration, k, v, v / (cp.total_ns || 1)])];
  };
  const breakdownCsv = () => {
    const b = D.breakdown, keys = ['span_ns', 'compute_ns', 'comm_exposed_ns', 'p2p_wait_ns', 'idle_ns'];
    return [['rank', 'where', ...keys], ...b.ranks.map((r, i) => [r, where(r), ...keys.map((k) => b[k][i])])];
  };
  const memoryCsv = () => {
    const m = D.memory, cell = (v) => (measured(v) ? v : '');
    if (!m.grid) return [['rank', 'peak bytes'], ...m.per_rank.map((v, r) => [r, cell(v)])];
    return [['pp', ...m.grid.values[0].map((_, j) => gridColumn(j))], ...m.grid.values.map((row, i) => [i, ...row.map(cell)])];
  };
  const memoryRanksCsv = () => {
    const src = memorySources();
    return [['rank', 'where', ...src.map((s) => s.label + ' (bytes)')],
      ...D.memory.per_rank.map((_, r) => [r, where(r), ...src.map((s) => (measured(s.v[r]) ? s.v[r] : ''))])];
  };
  const timelineCsv = () => {
    const T = timelineShown(), out = [['iteration', 'rank', 'lane', 'kind', 'start_ns', 'end_ns', 'name', 'critical']];
    D.timeline.ranks.forEach((r, i) => T.spans[i].forEach((sp) => out.push([T.iteration, r.rank, ...sp])));
    return out;
  };
  const commCsv = () => [['communicators', 'process groups'], ...commParts().map((p) => [p.label, p.v])];

  function save(name, blob) {
    const a = document.createElement('a');
    a.href = URL.createObjectURL(blob);
    a.download = name;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 60000); // the browser may still be reading it
  }
  function fileName(id, ext) {
    const chart = charts.find((c) => c.id === id);
    const stem = String(D.title || 'prism report').toLowerCase().replace(/[^a-z0-9]+/g, '-').replace(/^-|-$/g, '');
    return `${stem}-${id.replace(/-(chart|table)$/, '')}${chart && chart.iter ? '-iteration-' + shown : ''}.${ext}`;
  }
  function csvText(rows) { // RFC 4180: a field with a comma, a quote or a line break is quoted
    const field = (v) => { const s = v == null ? '' : String(v); return /[",\r\n]/.test(s) ? '"' + s.replace(/"/g, '""') + '"' : s; };
    return rows.map((r) => r.map(field).join(',')).join('\r\n') + '\r\n';
  }
  const tableRows = (table) => [...table.rows].map((tr) => [...tr.cells].map((c) => c.textContent.trim()));
  // The chart's <svg> as a file of its own: the page's stylesheet does not go with it, so the
  // computed look is written on the elements (on the root in full, below it where it differs from
  // the parent's: the rest is inherited); a white background, and the legend drawn below.
  const STYLED = ['fill', 'fill-opacity', 'stroke', 'stroke-width', 'stroke-opacity', 'opacity', 'visibility',
    'font-family', 'font-size', 'font-weight', 'font-style'];
  function svgFile(box) {
    const svg = box.querySelector('svg'), vb = svg.viewBox.baseVal, w = vb.width;
    const copy = svg.cloneNode(true);
    const look = (e) => { const cs = getComputedStyle(e); return STYLED.map((p) => cs.getPropertyValue(p)); };
    const looks = new Map([[svg, look(svg)]]);
    const css = (values, keep) => STYLED.map((p, k) => (keep(k) ? `${p}:${values[k]};` : '')).join('');
    copy.setAttribute('style', css(looks.get(svg), () => true));
    const from = svg.querySelectorAll('*'), to = copy.querySelectorAll('*'); // parents before children
    from.forEach((e, i) => {
      const mine = look(e), parent = looks.get(e.parentNode);
      looks.set(e, mine);
      // opacity is not inherited: any but 1 is the element's own
      const own = css(mine, (k) => (STYLED[k] === 'opacity' ? mine[k] !== '1' : mine[k] !== parent[k]));
      if (own) to[i].setAttribute('style', own);
      to[i].removeAttribute('data-tip');
    });
    copy.insertBefore(svgEl('rect', { x: 0, y: 0, width: w, height: '100%', fill: '#fff' }), copy.firstChild);
    let h = vb.height, x = 8;
    const items = box.querySelectorAll('.legend > span');
    if (items.length) h += 8;
    items.forEach((it) => {
      const label = it.textContent, sw = it.querySelector('.sw'), iw = 30 + label.length * 6.5;
      if (x > 8 && x + iw > w) { x = 8; h += 18; }
      const flat = sw.classList.contains('flat');
      svgEl('rect', { x: x, y: h + (flat ? 4 : 0), width: 11, height: flat ? 4 : 11, fill: getComputedStyle(sw).backgroundColor }, copy);
      text(copy, x + 16, h + 10, label, { style: 'font: 12px sans-serif; fill: #5b6475' });
      x += iw;
    });
    if (items.length) h += 18;
    copy.setAttribute('viewBox', `0 0 ${w} ${h}`);
    copy.setAttribute('width', w);
    copy.setAttribute('height', h);
    return { text: '<?xml version="1.0" encoding="UTF-8"?>\n' + new XMLSerializer().serializeToString(copy), w: w, h: h };
  }
  const PNG_SCALE = 2; // pixels per SVG unit: sharp on a high-density screen
  function savePng(box, name) { // the SVG drawn onto a canvas (an image from a data: address, which the page allows)
    const f = svgFile(box), img = new Image();
    img.onload = () => {
      const c = document.createElement('canvas');
      c.width = Math.round(f.w * PNG_SCALE);
      c.height = Math.round(f.h * PNG_SCALE);
      c.getContext('2d').drawImage(img, 0, 0, c.width, c.height);
      c.toBlob((b) => save(name, b), 'image/png');
    };
    img.onerror = () => console.error('the chart could not be drawn as a PNG');
    img.src = 'data:image/svg+xml;charset=utf-8,' + encodeURIComponent(f.text);
  }
  function addDownloads() {
    document.querySelectorAll('[data-dl]').forEach((h) => {
      const id = h.getAttribute('data-dl'), target = document.getElementById(id);
      const chart = charts.find((c) => c.id === id);
      if (!target || (chart && !target.querySelector('svg'))) return; // a chart not drawn
      const span = document.createElement('span');
      span.className = 'dl';
      const button = (label, title, make) => {
        const b = document.createElement('button');
        b.type = 'button';
        b.textContent = label;
        b.title = title;
        b.setAttribute('data-as', label.toLowerCase());
        b.addEventListener('click', make);
        span.appendChild(b);
      };
      const csv = (rows) => save(fileName(id, 'csv'), new Blob([csvText(rows)], { type: 'text/csv' }));
      if (chart) {
        button('SVG', 'Download this chart as SVG', () => save(fileName(id, 'svg'), new Blob([svgFile(target).text], { type: 'image/svg+xml' })));
        button('PNG', 'Download this chart as PNG', () => savePng(target, fileName(id, 'png')));
        button('CSV', 'Download the data behind this chart as CSV', () => csv(chart.csv()));
      } else {
        button('CSV', 'Download this table as CSV', () => csv(tableRows(target)));
      }
      h.appendChild(span);
    });
  }

  // ------------------------------------------------------------------ start
  const charts = [
    { id: 'cp-chart', has: () => D.critical_path, draw: drawCritical, csv: criticalCsv, iter: true },
    { id: 'breakdown-chart', has: () => D.breakdown && D.breakdown.ranks && D.breakdown.ranks.length, draw: drawBreakdown,
      csv: breakdownCsv },
    { id: 'memory-chart', has: () => D.memory && D.memory.known, draw: drawMemory, csv: memoryCsv },
    { id: 'memory-ranks-chart', has: () => D.memory && D.memory.known, draw: drawMemoryRanks, csv: memoryRanksCsv },
    { id: 'timeline-chart', has: () => D.timeline && D.timeline.ranks && D.timeline.ranks.length, draw: drawTimeline,
      csv: timelineCsv, iter: true },
    { id: 'comm-chart', has: () => D.communicators, draw: drawCommunicators, csv: commCsv },
  ];
  function drawAll() {
    for (const { id, has, draw } of charts) {
      const box = document.getElementById(id);
      if (!box || !has()) continue;
      try {
        draw(box);
      } catch (err) { // one broken chart must not take the others down
        box.textContent = 'This chart could not be drawn: ' + err;
        console.error(err);
      }
    }
  }
  drawAll();
  addDownloads();
  // printing lays the page out anew (narrower): draw the charts at that width, and back after
  window.matchMedia('print').addEventListener('change', drawAll);
  let lastW = window.innerWidth, timer = 0;
  window.addEventListener('resize', () => {
    if (window.innerWidth === lastW) return;
    lastW = window.innerWidth;
    clearTimeout(timer);
    timer = setTimeout(drawAll, 150);
  });
}());
