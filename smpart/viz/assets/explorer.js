/* smpart partition explorer.
 *
 * Reads the JSON embedded by smpart/viz/html.py and draws: a collapsible module tree, an icicle
 * map of the model (canvas), per-stage bars, a selected-module panel, and optionally a pipeline
 * timeline (SVG) and a sortable plans table. Partitions for a grid of memory weights x stage
 * counts are embedded run-length encoded; switching between them is a lookup, no Python runs.
 *
 * Module names come from user code: they are only ever written with textContent, as attribute
 * values, or onto a canvas, never parsed as HTML.
 *
 * Why one file of ~1,300 lines: it is inlined whole into one offline page (no build step, no
 * module loader), and its views share one closure's state (the data, the selected partition and
 * module); each view is a section below, marked by a ==== rule.
 */
(function () {
  'use strict';

  const DATA = JSON.parse(document.getElementById('smpart-data').textContent);

  // ================================================================ small helpers
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  const SVG_NS = 'http://www.w3.org/2000/svg';
  function svg(tag, attrs) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    return e;
  }
  function clamp(x, lo, hi) { return Math.max(lo, Math.min(hi, x)); }

  function fmtScaled(x, units, base) {
    let i = 0;
    let v = Math.abs(x);
    while (v >= base && i < units.length - 1) { v /= base; i++; }
    const digits = v >= 100 ? 0 : v >= 10 ? 1 : 2;
    return (x < 0 ? '-' : '') + v.toFixed(i === 0 && Number.isInteger(v) ? 0 : digits) + units[i];
  }
  const fmtBytes = (b) => fmtScaled(b, [' B', ' KiB', ' MiB', ' GiB', ' TiB', ' PiB'], 1024);
  const fmtCount = (n) => fmtScaled(n, ['', 'K', 'M', 'B', 'T'], 1000);
  const fmtFlops = (f) => fmtScaled(f, [' FLOP', ' KFLOP', ' MFLOP', ' GFLOP', ' TFLOP', ' PFLOP', ' EFLOP'], 1000);
  function fmtSeconds(s) {
    const a = Math.abs(s);
    if (a === 0) return '0 s';
    if (a < 1e-3) return (s * 1e6).toFixed(a < 1e-5 ? 2 : 1) + ' µs';
    if (a < 1) return (s * 1e3).toFixed(a < 1e-2 ? 2 : 1) + ' ms';
    return s.toFixed(a < 10 ? 2 : 1) + ' s';
  }
  const fmtCompute = DATA.unit === 'time' ? fmtSeconds : fmtFlops;
  function fmtPct(x) {
    if (x <= 0) return '0%';
    if (x < 0.001) return '<0.1%';
    return (x * 100).toFixed(x < 0.1 ? 1 : 0) + '%';
  }

  // ================================================================ stage colours
  const PALETTE = ['#5b6cf0', '#14b8a6', '#f59e0b', '#ef476f', '#8b5cf6', '#0ea5e9', '#84cc16', '#f97316',
    '#ec4899', '#10b981', '#6366f1', '#eab308', '#06b6d4', '#a855f7', '#22c55e', '#e11d48'];
  function stageColor(s) {
    if (s < PALETTE.length) return PALETTE[s];
    return 'hsl(' + ((s * 137.508) % 360).toFixed(1) + ' 62% 52%)';
  }
  function hexRgb(hex) {
    const n = parseInt(hex.slice(1), 16);
    return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
  }
  /** The stage colour mixed with white; t = 0 is the colour itself. */
  function tint(s, t) {
    const c = stageColor(s);
    if (c[0] !== '#') return c;
    const [r, g, b] = hexRgb(c).map((v) => Math.round(v + (255 - v) * t));
    return 'rgb(' + r + ',' + g + ',' + b + ')';
  }
  function shade(s, t) {
    const c = stageColor(s);
    if (c[0] !== '#') return c;
    const [r, g, b] = hexRgb(c).map((v) => Math.round(v * (1 - t)));
    return 'rgb(' + r + ',' + g + ',' + b + ')';
  }
  function badge(stages) {
    // stages: [[stage, share], ...] over the node's subtree
    const b = el('span', 'badge');
    if (stages.length === 1) {
      b.style.background = stageColor(stages[0][0]);
      b.textContent = String(stages[0][0]);
    } else {
      b.classList.add('mixed');
      for (const [s, share] of stages) {
        const part = el('span');
        part.style.background = stageColor(s);
        part.style.width = (share * 100).toFixed(2) + '%';
        b.appendChild(part);
      }
    }
    return b;
  }

  // ================================================================ the tree model
  const T = DATA.tree;
  const N = T.name.length;
  const parentOf = Int32Array.from(T.parent);
  const children = Array.from({ length: N }, () => []);
  for (let i = 1; i < N; i++) children[parentOf[i]].push(i);
  const depth = new Int32Array(N);
  for (let i = 1; i < N; i++) depth[i] = depth[parentOf[i]] + 1;
  // Nodes come in pre-order, so a subtree is the contiguous index range [i, end[i]).
  const end = new Int32Array(N);
  for (let i = N - 1; i >= 0; i--) {
    end[i] = Math.max(end[i], i + 1);
    if (i > 0) end[parentOf[i]] = Math.max(end[parentOf[i]], end[i]);
  }
  const ownCompute = Float64Array.from(T.compute);
  const ownMemory = new Float64Array(N);
  for (let i = 0; i < N; i++) ownMemory[i] = T.pmem[i] + T.bmem[i] + T.amem[i];
  function subtreeSum(own) {
    const tot = Float64Array.from(own);
    for (let i = N - 1; i > 0; i--) tot[parentOf[i]] += tot[i];
    return tot;
  }
  const totCompute = subtreeSum(ownCompute);
  const totMemory = subtreeSum(ownMemory);
  const totParams = subtreeSum(Float64Array.from(T.params));
  const totPmem = subtreeSum(Float64Array.from(T.pmem));
  const totBmem = subtreeSum(Float64Array.from(T.bmem));
  const totAmem = subtreeSum(Float64Array.from(T.amem));
  const ALL_COMPUTE = totCompute[0] || 1;
  const ALL_MEMORY = totMemory[0] || 1;
  const aliasesOf = (i) => T.aliases[String(i)] || [];
  const className = (i) => T.classes[T.cls[i]];

  /** The name relative to the parent ("7" under "transformer.h"), the full name otherwise. */
  function localName(i) {
    const name = T.name[i];
    if (i === 0) return name === '' ? '(model)' : name;
    const p = T.name[parentOf[i]];
    if (p === '') return name;
    return name.startsWith(p + '.') ? name.slice(p.length + 1) : name;
  }
  const displayName = (i) => (T.name[i] === '' ? '(model)' : T.name[i]);

  // ================================================================ tensor parallelism
  // What the partition's tensor-parallel plan splits (none without one: the degree is unknown).
  // The split is per module, not per stage, so it holds for every partition of the grid.
  const TP = DATA.base.tp || null;
  const tpStyle = (i) => (TP && TP.split[String(i)]) || '';
  const splitBelow = new Int32Array(N);   // split nodes strictly inside each subtree
  if (TP) for (let i = N - 1; i > 0; i--) splitBelow[parentOf[i]] += splitBelow[i] + (tpStyle(i) ? 1 : 0);
  const SPLIT_COUNT = TP ? Object.keys(TP.split).length : 0;
  function tpTag(i) {
    const style = tpStyle(i);
    const tag = el('span', 'tp-tag', 'tp×' + TP.degree + ' ' + style);
    tag.title = 'tp×' + TP.degree + ' ' + style + ': ' + (TP.explain[style] || '');
    return tag;
  }

  // ================================================================ partitions
  function decodeRuns(runs) {
    const out = new Int16Array(N);
    let k = 0;
    for (let r = 0; r < runs.length; r += 2) {
      out.fill(runs[r], k, k + runs[r + 1]);
      k += runs[r + 1];
    }
    return out;
  }
  const GRID = DATA.grid || { weights: [], stages: [], parts: [] };
  const gridKey = (w, s) => s + '|' + Number(w).toFixed(4);
  const gridIndex = new Map(GRID.parts.map((p) => [gridKey(p.w, p.s), p]));

  const state = {
    part: DATA.base,          // the partition shown
    isBase: true,
    stage: decodeRuns(DATA.base.runs),
    sizeBy: 'compute',
    selected: -1,
    focus: 0,                 // icicle zoom root
    weightIndex: 0,
    stages: DATA.base.s,      // the stage count picked (may have no precomputed partition)
    moved: null,              // nodes that changed stage with the last switch
  };

  /** Per-stage sums over the whole model for the shown partition. */
  function stageLoads() {
    const S = state.part.s;
    const w = state.part.w;
    const loads = Array.from({ length: S }, () => ({ compute: 0, memory: 0, params: 0, cost: 0 }));
    for (let i = 0; i < N; i++) {
      const L = loads[state.stage[i]];
      L.compute += ownCompute[i];
      L.memory += ownMemory[i];
      L.params += T.params[i];
      L.cost += (1 - w) * ownCompute[i] / ALL_COMPUTE + w * ownMemory[i] / ALL_MEMORY;
    }
    return loads;
  }
  function imbalance(values) {
    const mean = values.reduce((a, b) => a + b, 0) / values.length;
    return mean > 0 ? Math.max(...values) / mean : 1;
  }
  /** [[stage, share of size], ...] of node i's subtree, stages in order. */
  function subtreeStages(i, own) {
    const sums = new Map();
    let total = 0;
    for (let j = i; j < end[i]; j++) {
      sums.set(state.stage[j], (sums.get(state.stage[j]) || 0) + own[j]);
      total += own[j];
    }
    const keys = [...sums.keys()].sort((a, b) => a - b);
    if (keys.length === 1 || total === 0) return [[state.stage[i], 1]];
    return keys.filter((s) => sums.get(s) > 0).map((s) => [s, sums.get(s) / total]);
  }
  const sizeOwn = () => (state.sizeBy === 'memory' ? ownMemory : ownCompute);
  const sizeTot = () => (state.sizeBy === 'memory' ? totMemory : totCompute);

  // ================================================================ header
  function renderHeader() {
    document.getElementById('title').textContent = DATA.title;
    const classes = new Set(T.cls).size;
    document.getElementById('subtitle').textContent =
      N + ' nodes · ' + classes + ' module classes · compute in ' + (DATA.unit === 'time' ? 'measured seconds' : 'FLOPs');
    renderStats();
    const note = document.getElementById('note');
    note.textContent = GRID.parts.length + ' precomputed partitions' + (GRID.note ? ' · ' + GRID.note : '');
  }
  function stat(k, v, cls) {
    const box = el('div', 'stat');
    box.appendChild(el('div', 'k', k));
    box.appendChild(el('div', 'v' + (cls ? ' ' + cls : ''), v));
    return box;
  }
  function renderStats() {
    const loads = stageLoads();
    const imb = imbalance(loads.map((l) => l.cost));
    const stats = document.getElementById('stats');
    stats.replaceChildren(
      stat('parameters', fmtCount(totParams[0])),
      stat('compute', fmtCompute(totCompute[0])),
      stat('train memory', fmtBytes(totMemory[0])),
      stat('stages', String(state.part.s)),
      stat('imbalance', imb.toFixed(2) + '×', imb > 1.25 ? 'bad' : imb < 1.08 ? 'good' : ''),
    );
  }

  // ================================================================ controls
  const weightInput = document.getElementById('weight');
  const weightValue = document.getElementById('weight-value');
  const stagePicker = document.getElementById('stage-picker');

  function nearestWeightIndex(w) {
    let best = 0;
    GRID.weights.forEach((x, k) => { if (Math.abs(x - w) < Math.abs(GRID.weights[best] - w)) best = k; });
    return best;
  }
  function renderControls() {
    const weights = GRID.weights.length ? GRID.weights : [DATA.base.w];
    weightInput.max = String(weights.length - 1);
    state.weightIndex = GRID.weights.length ? nearestWeightIndex(DATA.base.w) : 0;
    weightInput.value = String(state.weightIndex);
    weightInput.disabled = GRID.weights.length < 2;
    const stages = [...new Set([...GRID.stages, DATA.base.s])].sort((a, b) => a - b);
    stagePicker.replaceChildren(...stages.map((s) => {
      const b = el('button', '', String(s));
      b.type = 'button';
      b.dataset.stages = String(s);
      if (s === DATA.base.s) { b.classList.add('base'); b.title = 'your partition has ' + s + ' stages'; }
      b.addEventListener('click', () => { state.stages = s; pickFromGrid(); });
      return b;
    }));
    weightInput.addEventListener('input', () => { state.weightIndex = Number(weightInput.value); pickFromGrid(); });
    document.getElementById('reset').addEventListener('click', () => showPartition(DATA.base, true));
    for (const b of document.querySelectorAll('#size-by button')) {
      b.addEventListener('click', () => {
        state.sizeBy = b.dataset.size;
        for (const o of document.querySelectorAll('#size-by button')) o.classList.toggle('active', o === b);
        layoutIcicle();
        drawIcicle();
        refreshTreeBadges();
      });
    }
    syncControls();
  }
  function syncControls() {
    const w = GRID.weights.length ? GRID.weights[state.weightIndex] : DATA.base.w;
    weightValue.textContent = (state.isBase ? state.part.w : w).toFixed(2);
    for (const b of stagePicker.children) b.classList.toggle('active', Number(b.dataset.stages) === state.part.s);
    const showing = document.getElementById('showing');
    const what = state.isBase ? DATA.base.label : 'grid';
    showing.replaceChildren(el('b', '', what), document.createTextNode(
      ' · w ' + state.part.w.toFixed(1) + ' · ' + state.part.s + ' stage' + (state.part.s > 1 ? 's' : '')));
    if (state.moved !== null) {
      showing.appendChild(document.createTextNode(' · '));
      const moved = el('span', 'moved', state.moved + ' moved');
      moved.title = state.moved + ' node(s) changed stage with the last switch';
      showing.appendChild(moved);
    }
    document.getElementById('reset').hidden = state.isBase;
  }
  function pickFromGrid() {
    const w = GRID.weights.length ? GRID.weights[state.weightIndex] : DATA.base.w;
    const entry = gridIndex.get(gridKey(w, state.stages));
    if (entry) showPartition(entry, false);
    else if (state.stages === DATA.base.s && Math.abs(w - DATA.base.w) < 1e-9) showPartition(DATA.base, true);
    else {
      const showing = document.getElementById('showing');
      showing.replaceChildren(el('b', '', 'not precomputed'),
        document.createTextNode(' · w ' + w.toFixed(1) + ' · ' + state.stages + ' stages'));
    }
  }
  function showPartition(part, isBase) {
    const next = decodeRuns(part.runs);
    let moved = 0;
    const movedSet = new Set();
    for (let i = 0; i < N; i++) if (next[i] !== state.stage[i]) { moved++; movedSet.add(i); }
    state.part = part;
    state.isBase = isBase;
    state.stage = next;
    state.stages = part.s;
    state.moved = moved;
    if (isBase && GRID.weights.length) {
      state.weightIndex = nearestWeightIndex(part.w);
      weightInput.value = String(state.weightIndex);
    }
    syncControls();
    renderStats();
    refreshTreeStages(movedSet);
    renderLegend();
    drawIcicle();
    renderStageBars();
    renderDetails();
  }

  // ================================================================ module tree (DOM)
  const treeBox = document.getElementById('tree');
  const INITIAL_ROWS = 120;
  const rows = new Map();          // node index -> row element (rendered rows only)
  const kidBoxes = new Map();      // node index -> children container
  const expanded = new Set();

  function shareCell(frac, kind) {
    const cell = el('span', 'share');
    const track = el('span', 'track');
    const fill = el('span', 'fill ' + kind);
    fill.style.width = clamp(frac * 100, frac > 0 ? 1.5 : 0, 100).toFixed(1) + '%';
    track.appendChild(fill);
    cell.appendChild(track);
    cell.appendChild(el('span', 'pct', fmtPct(frac)));
    return cell;
  }
  function makeRow(i) {
    const row = el('div', 'row');
    row.setAttribute('role', 'treeitem');
    row.dataset.idx = String(i);
    row.dataset.name = T.name[i];
    if (children[i].length) row.setAttribute('aria-expanded', 'false');
    row.style.paddingLeft = (depth[i] * 12) + 'px';
    const name = el('span', 'cell-name');
    const caret = el('button', 'caret' + (children[i].length ? '' : ' none'), '▶');
    caret.type = 'button';
    caret.setAttribute('aria-label', 'expand');
    caret.addEventListener('click', (ev) => { ev.stopPropagation(); toggle(i); });
    name.appendChild(caret);
    name.appendChild(el('span', 'badge'));
    const label = el('span', 'nm', localName(i));
    label.title = displayName(i) + (aliasesOf(i).length ? ' (one node with ' + aliasesOf(i).join(', ') + ')' : '');
    name.appendChild(label);
    if (tpStyle(i)) {  // before the class name, which gives way first in a narrow panel
      name.appendChild(tpTag(i));
      row.classList.add('split');
    }
    name.appendChild(el('span', 'cls', className(i)));
    if (aliasesOf(i).length) {
      const tag = el('span', 'alias', 'tied');
      tag.title = 'one node with ' + aliasesOf(i).join(', ') + ': they share parameters, so they share a stage';
      name.appendChild(tag);
    }
    row.appendChild(name);
    row.appendChild(el('span', 'num', totParams[i] ? fmtCount(totParams[i]) : '–'));
    row.appendChild(shareCell(totCompute[i] / ALL_COMPUTE, 'c'));
    row.appendChild(shareCell(totMemory[i] / ALL_MEMORY, 'm'));
    const calls = T.calls[i];
    row.appendChild(el('span', 'calls' + (calls > 1 ? ' many' : ''), calls === 0 ? '–' : '×' + calls));
    row.addEventListener('click', () => select(i, { from: 'tree' }));
    row.addEventListener('dblclick', () => toggle(i));
    refreshRowStage(row, i);
    return row;
  }
  function refreshRowStage(row, i) {
    row.dataset.stage = String(state.stage[i]);
    const old = row.querySelector('.badge');
    const b = badge(subtreeStages(i, sizeOwn()));
    b.title = 'own stage ' + state.stage[i];
    old.replaceWith(b);
  }
  function refreshTreeStages(movedSet) {
    for (const [i, row] of rows) {
      refreshRowStage(row, i);
      row.classList.remove('moved');
      if (movedSet && movedSet.has(i)) {
        void row.offsetWidth; // restart the pulse animation
        row.classList.add('moved');
      }
    }
  }
  /** Badges split a subtree by the size measure, so they change with the compute/memory toggle. */
  function refreshTreeBadges() {
    for (const [i, row] of rows) refreshRowStage(row, i);
  }
  function renderChildren(i) {
    let box = kidBoxes.get(i);
    if (box) return box;
    box = el('div', 'kids');
    box.setAttribute('role', 'group');
    for (const c of children[i]) box.appendChild(addRow(c));
    rows.get(i).after(box);
    kidBoxes.set(i, box);
    return box;
  }
  function addRow(i) {
    const row = makeRow(i);
    rows.set(i, row);
    return row;
  }
  function setOpen(i, open) {
    if (!children[i].length) return;
    const row = rows.get(i);
    if (open) {
      renderChildren(i).hidden = false;
      expanded.add(i);
    } else {
      const box = kidBoxes.get(i);
      if (box) box.hidden = true;
      expanded.delete(i);
    }
    row.setAttribute('aria-expanded', open ? 'true' : 'false');
    row.querySelector('.caret').classList.toggle('open', open);
  }
  const toggle = (i) => setOpen(i, !expanded.has(i));
  function reveal(i) {
    const chain = [];
    for (let p = parentOf[i]; p >= 0; p = parentOf[p]) chain.push(p);
    for (const p of chain.reverse()) setOpen(p, true);
    return rows.get(i);
  }
  function renderTree() {
    treeBox.replaceChildren(addRow(0));
    setOpen(0, true);
    // Open whole levels while the rows stay few (GPT-3: down to its 96 blocks), so the page
    // starts with every stage in sight.
    let level = [0];
    let shown = 1;
    while (level.length) {
      const next = level.flatMap((i) => children[i]);
      if (!next.length || shown + next.length > INITIAL_ROWS) break;
      for (const i of level) setOpen(i, true);
      shown += next.length;
      level = next;
    }
    document.getElementById('expand-all').addEventListener('click', () => {
      // Every node up to a depth that keeps the page responsive (a few thousand rows).
      let budget = 4000;
      for (let i = 0; i < N && budget > 0; i++) {
        if (children[i].length && rows.has(i)) { setOpen(i, true); budget -= children[i].length; }
      }
    });
    document.getElementById('collapse-all').addEventListener('click', () => {
      for (const i of [...expanded]) if (i !== 0) setOpen(i, false);
    });
  }

  // ================================================================ selection
  function select(i, opts) {
    const from = (opts && opts.from) || '';
    const prev = rows.get(state.selected);
    if (prev) { prev.classList.remove('selected'); prev.removeAttribute('aria-selected'); }
    state.selected = i;
    const row = reveal(i);
    row.classList.add('selected');
    row.setAttribute('aria-selected', 'true');
    if (from !== 'tree') {
      // Scroll the tree panel only, never the page under the user's pointer.
      treeBox.scrollTo({ top: row.offsetTop - treeBox.clientHeight / 2 + row.offsetHeight / 2,
        behavior: from === 'search' ? 'auto' : 'smooth' });
      row.classList.remove('flash');
      void row.offsetWidth;
      row.classList.add('flash');
    }
    if (from !== 'map') ensureVisibleInMap(i);
    drawIcicle();
    renderDetails();
  }

  // ================================================================ details panel
  function renderDetails() {
    const box = document.getElementById('details');
    const i = state.selected;
    if (i < 0) return;
    const parts = [];
    const path = el('div', 'path');
    const chain = [];
    for (let p = parentOf[i]; p >= 0; p = parentOf[p]) chain.unshift(p);
    chain.forEach((p, k) => {
      const b = el('button', '', localName(p));
      b.type = 'button';
      b.addEventListener('click', () => select(p, { from: 'details' }));
      path.appendChild(b);
      if (k < chain.length) path.appendChild(document.createTextNode('›'));
    });
    parts.push(path);
    const title = el('div', 'title');
    title.appendChild(badge([[state.stage[i], 1]]));
    title.appendChild(el('span', 'full', displayName(i)));
    parts.push(title);
    const aliases = aliasesOf(i);
    const calls = T.calls[i];
    parts.push(el('div', 'sub', className(i) + ' · own stage ' + state.stage[i] + ' · ' +
      (calls === 0 ? 'never called in the traced step' : 'called ' + calls + '× per step') +
      (aliases.length ? ' · also ' + aliases.join(', ') : '') +
      (children[i].length ? ' · ' + children[i].length + ' children' : '')));
    if (TP) parts.push(tensorParallelNote(i));

    const table = el('table');
    const head = el('tr');
    for (const h of ['', 'own', 'subtree', 'share']) head.appendChild(el('th', '', h));
    table.appendChild(head);
    const line = (label, own, sub, share) => {
      const tr = el('tr');
      for (const v of [label, own, sub, share]) tr.appendChild(el('td', '', v));
      table.appendChild(tr);
    };
    line('parameters', fmtCount(T.params[i]), fmtCount(totParams[i]), fmtPct(totParams[i] / (totParams[0] || 1)));
    line('compute', fmtCompute(ownCompute[i]), fmtCompute(totCompute[i]), fmtPct(totCompute[i] / ALL_COMPUTE));
    line('memory', fmtBytes(ownMemory[i]), fmtBytes(totMemory[i]), fmtPct(totMemory[i] / ALL_MEMORY));
    line('· weights+optimizer', fmtBytes(T.pmem[i]), fmtBytes(totPmem[i]), '');
    line('· buffers', fmtBytes(T.bmem[i]), fmtBytes(totBmem[i]), '');
    line('· activations', fmtBytes(T.amem[i]), fmtBytes(totAmem[i]), '');
    parts.push(table);

    const spread = subtreeStages(i, sizeOwn());
    const bar = el('div', 'spread');
    for (const [s, share] of spread) {
      const seg = el('span');
      seg.style.background = stageColor(s);
      seg.style.width = (share * 100).toFixed(2) + '%';
      seg.title = 'stage ' + s + ': ' + fmtPct(share);
      bar.appendChild(seg);
    }
    parts.push(bar);
    parts.push(el('div', 'spread-note', spread.length === 1
      ? 'The whole subtree lives on stage ' + spread[0][0] + '.'
      : 'The subtree spans stages ' + spread.map((x) => x[0] + ' (' + fmtPct(x[1]) + ')').join(', ') +
        ' of its ' + state.sizeBy + '.'));
    box.replaceChildren(...parts);
  }

  /** How node i is split across its tensor-parallel group, and what that means for its weight. */
  function tensorParallelNote(i) {
    const note = el('div', 'tp-note');
    const style = tpStyle(i);
    if (style) {
      note.classList.add('split');
      note.appendChild(tpTag(i));
      note.appendChild(document.createTextNode(' ' + (TP.explain[style] || '') + '.'));
    } else if (T.params[i] > 0) {
      note.textContent = 'Not split by tensor parallelism: each of the ' + TP.degree + ' ranks holds all of it.';
    }
    if (splitBelow[i] > 0) {
      note.appendChild(el('div', 'inside', splitBelow[i] + ' module' + (splitBelow[i] > 1 ? 's' : '') +
        ' inside ' + (splitBelow[i] > 1 ? 'are' : 'is') + ' split ' + TP.degree + ' ways.'));
    }
    return note;
  }

  // ================================================================ stage balance
  function figure(k, v, unit, bad) {
    const f = el('div', 'figure');
    f.appendChild(el('div', 'k', k));
    const val = el('div', 'v' + (bad ? ' bad' : ''), v);
    if (unit) val.appendChild(el('small', '', unit));
    f.appendChild(val);
    return f;
  }
  function renderStageBars() {
    const loads = stageLoads();
    const S = loads.length;
    const cImb = imbalance(loads.map((l) => l.compute));
    const mImb = imbalance(loads.map((l) => l.memory));
    const wImb = imbalance(loads.map((l) => l.cost));
    const weighted = figure('weighted', wImb.toFixed(2), '×', wImb > 1.25);
    weighted.title = 'heaviest stage ÷ mean, in the cost the partitioner balances: ' +
      '(1 − w)·compute + w·memory, w = ' + state.part.w.toFixed(2);
    const traffic = figure('cut traffic', fmtBytes(state.part.cut), '/step');
    traffic.title = 'activation bytes per step that cross a stage boundary';
    const devices = state.isBase || (DATA.base.devices && DATA.base.devices.memory.length === S)
      ? DATA.base.devices : null;
    // On devices of unequal speed a stage's time is its weighted cost ÷ its device's speed
    // (relative to the fastest): that is what the partitioner balanced, against the time of a
    // perfect balance, total cost ÷ total speed.
    const speeds = devices && devices.tflops ? relativeSpeeds(devices.tflops.slice(0, S)) : null;
    const times = speeds ? loads.map((l, s) => l.cost / speeds[s]) : null;
    const balanced = speeds ? loads.reduce((a, l) => a + l.cost, 0) / speeds.reduce((a, v) => a + v, 0) : 0;
    const tImb = times && balanced > 0 ? Math.max(...times) / balanced : 1;
    const figures = [weighted, figure('compute', cImb.toFixed(2), '×', cImb > 1.25),
      figure('memory', mImb.toFixed(2), '×', mImb > 1.25), traffic];
    if (times) {
      const time = figure('time', tImb.toFixed(2), '×', tImb > 1.25);
      time.id = 'time-figure';
      time.title = 'slowest stage\'s time ÷ a perfect balance\'s: each stage\'s weighted cost ÷ its ' +
        'device\'s speed, against total cost ÷ total speed';
      figures.unshift(time);
    }
    document.getElementById('figures').replaceChildren(...figures);
    const maxC = Math.max(...loads.map((l) => l.compute)) || 1;
    const meanC = loads.reduce((a, l) => a + l.compute, 0) / S;
    const meanM = loads.reduce((a, l) => a + l.memory, 0) / S;
    const maxM = Math.max(...loads.map((l) => l.memory), ...(devices ? devices.memory.slice(0, S) : [])) || 1;
    // Name a bottleneck only when there is one worth naming.
    const pace = times || loads.map((l) => l.cost);
    const slowest = (times ? tImb : wImb) > 1.05 ? pace.reduce((b, t, k) => (t > pace[b] ? k : b), 0) : -1;
    const maxT = times ? Math.max(...times, balanced) || 1 : 1;
    const rowsOut = loads.map((L, s) => {
      const row = el('div', 'stage-row');
      row.dataset.stage = String(s);
      const who = el('div', 'who');
      const b = badge([[s, 1]]);
      b.textContent = 'stage ' + s;
      who.appendChild(b);
      if (devices && devices.names[s]) who.appendChild(el('span', 'dev', devices.names[s]));
      if (speeds) {
        const speed = el('span', 'dev speed', fmtTflops(devices.tflops[s]));
        speed.title = 'peak TFLOPS of this stage\'s device: ' + (speeds[s] * 100).toFixed(0) + '% of the fastest';
        who.appendChild(speed);
      }
      who.appendChild(el('span', 'dev', fmtCount(L.params) + ' params'));
      if (s === slowest) {
        const tag = el('span', 'slowest', 'bottleneck');
        tag.title = 'the heaviest stage: it sets the pipeline\'s pace';
        who.appendChild(tag);
      }
      row.appendChild(who);
      const bars = el('div', 'bars');
      if (times) {
        const time = barLine('time', times[s] / maxT, stageColor(s), (times[s] / balanced).toFixed(2) + '× balanced', false);
        const mark = meanMark(balanced / maxT, '');
        mark.title = 'a perfect balance: every stage this long (total cost ÷ total speed)';
        time.querySelector('.track').appendChild(mark);
        time.classList.add('time');
        bars.appendChild(time);
      }
      const compute = barLine('compute', L.compute / maxC, stageColor(s), fmtCompute(L.compute), false);
      compute.querySelector('.track').appendChild(meanMark(meanC / maxC, fmtCompute(meanC)));
      bars.appendChild(compute);
      const cap = devices && devices.memory[s] ? devices.memory[s] : 0;
      const memText = fmtBytes(L.memory) + (cap ? ' / ' + fmtBytes(cap) : '');
      const line = barLine('memory', L.memory / maxM, stageColor(s), memText, cap > 0 && L.memory > cap);
      line.querySelector('.track').appendChild(meanMark(meanM / maxM, fmtBytes(meanM)));
      if (cap) {
        const mark = el('span', 'cap');
        mark.style.left = 'calc(' + clamp(cap / maxM * 100, 0, 100).toFixed(2) + '% - 1px)';
        mark.title = 'device memory ' + fmtBytes(cap);
        line.querySelector('.track').appendChild(mark);
      }
      bars.appendChild(line);
      row.appendChild(bars);
      return row;
    });
    document.getElementById('stage-bars').replaceChildren(...rowsOut);
  }
  /** Each speed as a share of the fastest. */
  function relativeSpeeds(tflops) {
    const fastest = Math.max(...tflops) || 1;
    return tflops.map((t) => t / fastest);
  }
  function fmtTflops(t) {
    return (t >= 100 ? t.toFixed(0) : t.toPrecision(3)) + ' TFLOPS';
  }
  /** A dashed tick at the mean: how far each bar sticks out past it is the imbalance. */
  function meanMark(frac, text) {
    const mark = el('span', 'mean');
    mark.style.left = clamp(frac * 100, 0, 100).toFixed(2) + '%';
    mark.title = 'mean over stages: ' + text;
    return mark;
  }
  function barLine(label, frac, color, text, over) {
    const line = el('div', 'bar');
    line.appendChild(el('span', 'lab', label));
    const track = el('span', 'track');
    const fill = el('span', 'fill' + (label === 'memory' ? ' mem' : ''));
    fill.style.width = clamp(frac * 100, 0, 100).toFixed(2) + '%';
    fill.style.background = over ? '#dc2626' : color;
    track.appendChild(fill);
    line.appendChild(track);
    line.appendChild(el('span', 'val' + (over ? ' over' : ''), text));
    return line;
  }
  function renderLegend() {
    const box = document.getElementById('legend');
    const items = [];
    for (let s = 0; s < state.part.s; s++) {
      const it = el('span', 'item');
      const sw = el('span', 'sw');
      sw.style.background = stageColor(s);
      it.appendChild(sw);
      it.appendChild(document.createTextNode('stage ' + s));
      items.push(it);
    }
    if (TP) {
      const it = el('span', 'item tp-legend');
      it.appendChild(el('span', 'tp-tag', 'tp×' + TP.degree));
      it.appendChild(document.createTextNode(SPLIT_COUNT + ' module' + (SPLIT_COUNT === 1 ? '' : 's') + ' split'));
      it.title = TP.summary;
      items.push(it);
    }
    box.replaceChildren(...items);
  }

  // ================================================================ icicle (canvas)
  const canvas = document.getElementById('icicle');
  const ctx = canvas.getContext('2d');
  const ribbon = document.getElementById('ribbon');
  const rctx = ribbon.getContext('2d');
  const pos = new Float64Array(N);   // left edge of each node's span, in size units
  const BAND_H = 20;                 // height of an ancestor band above the zoomed node
  let view = { x0: 0, x1: 1 };       // the visible span, animated between zooms
  let hits = [];                     // drawn blocks, for hover and click
  let hover = -1;
  let anim = 0;

  /** Own part first, then the children side by side: the own parts of all nodes, in tree order,
   * tile the axis, so any subtree is one contiguous stretch of it. */
  function layoutIcicle() {
    const own = sizeOwn();
    const tot = sizeTot();
    const cursor = new Float64Array(N);
    pos[0] = 0;
    cursor[0] = own[0];
    for (let i = 1; i < N; i++) {
      const p = parentOf[i];
      pos[i] = cursor[p];
      cursor[p] += tot[i];
      cursor[i] = pos[i] + own[i];
    }
    let f = state.focus;
    while (f > 0 && !tot[f]) f = parentOf[f];  // nothing of this measure under the old zoom
    state.focus = f;
    cancelAnimationFrame(anim);
    view = { x0: pos[f], x1: pos[f] + (tot[f] || 1) };
  }
  function fitCanvas(c, g) {
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth;
    const h = c.clientHeight;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    return [w, h];
  }
  function textColor(fill) {
    const m = /rgb\((\d+),(\d+),(\d+)\)/.exec(fill);
    const [r, g, b] = m ? [+m[1], +m[2], +m[3]] : fill[0] === '#' ? hexRgb(fill) : [80, 80, 80];
    return (0.299 * r + 0.587 * g + 0.114 * b) > 170 ? '#0f172a' : '#ffffff';
  }
  function maxDepthUnder(f) {
    const tot = sizeTot();
    let d = depth[f];
    for (let j = f; j < end[f]; j++) if (tot[j] > 0 && depth[j] > d) d = depth[j];
    return d - depth[f];
  }
  /** The stretches of node i's span, merged by stage: [[x0, x1, stage], ...]. */
  function stageRuns(i) {
    const own = sizeOwn();
    const out = [];
    for (let j = i; j < end[i]; j++) {
      if (own[j] <= 0) continue;
      const s = state.stage[j];
      const a = pos[j];
      const b = pos[j] + own[j];
      const last = out[out.length - 1];
      if (last && last[2] === s && Math.abs(last[1] - a) < 1e-9 * (1 + Math.abs(a))) last[1] = b;
      else out.push([a, b, s]);
    }
    return out;
  }
  function singleStage(i) {
    const s = state.stage[i];
    const own = sizeOwn();
    for (let j = i; j < end[i]; j++) if (own[j] > 0 && state.stage[j] !== s) return -1;
    return s;
  }
  function drawIcicle() {
    const [W, H] = fitCanvas(canvas, ctx);
    ctx.clearRect(0, 0, W, H);
    hits = [];
    const tot = sizeTot();
    const f = state.focus;
    const chain = [];
    for (let p = parentOf[f]; p >= 0; p = parentOf[p]) chain.unshift(p);
    const top = chain.length * BAND_H;
    const levels = maxDepthUnder(f) + 1;
    const rowH = clamp((H - top) / levels, 16, 96);
    const X = (x) => ((x - view.x0) / (view.x1 - view.x0)) * W;
    ctx.font = '600 11.5px ' + getComputedStyle(document.body).getPropertyValue('--sans');
    ctx.textBaseline = 'middle';

    // Ancestors of the zoomed node: thin full-width bands, click one to zoom out to it.
    chain.forEach((a, k) => {
      const y = k * BAND_H;
      ctx.fillStyle = k % 2 ? '#e9edf5' : '#eef1f7';
      ctx.fillRect(0, y, W, BAND_H - 1);
      ctx.fillStyle = '#475569';
      ctx.font = '500 11px ' + getComputedStyle(document.body).getPropertyValue('--mono');
      ctx.fillText('↑ ' + displayName(a) + '  ' + className(a), 8 + k * 10, y + BAND_H / 2);
      hits.push({ i: a, x: 0, y, w: W, h: BAND_H - 1, band: true });
    });
    if (!tot[f]) {
      ctx.fillStyle = '#94a3b8';
      ctx.fillText('no ' + state.sizeBy + ' recorded under ' + displayName(f), 12, top + 20);
      return;
    }
    const labelFont = '600 11.5px ' + getComputedStyle(document.body).getPropertyValue('--sans');
    const subFont = '400 10.5px ' + getComputedStyle(document.body).getPropertyValue('--sans');
    for (let i = f; i < end[f]; i++) {
      if (tot[i] <= 0) continue;
      const x0 = X(pos[i]);
      const x1 = X(pos[i] + tot[i]);
      if (x1 < 0 || x0 > W || x1 - x0 < 0.35) continue;
      const y = top + (depth[i] - depth[f]) * rowH;
      const w = x1 - x0;
      const h = rowH - 1;
      const single = singleStage(i);
      const leafish = !children[i].length;
      const lighten = leafish ? 0 : 0.28;
      if (single >= 0) {
        ctx.fillStyle = tint(single, lighten);
        ctx.fillRect(x0, y, w, h);
      } else {
        for (const [a, b, s] of stageRuns(i)) {
          ctx.fillStyle = tint(s, lighten);
          ctx.fillRect(Math.max(X(a), x0), y, Math.min(X(b), x1) - Math.max(X(a), x0), h);
        }
      }
      // white hairlines between blocks
      ctx.fillStyle = 'rgba(255,255,255,0.9)';
      if (w > 2) ctx.fillRect(x1 - 1, y, 1, h);
      ctx.fillRect(x0, y + h, w, 1);
      if (i === hover) {
        ctx.fillStyle = 'rgba(255,255,255,0.28)';
        ctx.fillRect(x0, y, w, h);
      }
      if (i === state.selected) {
        ctx.strokeStyle = '#0f172a';
        ctx.lineWidth = 2;
        ctx.strokeRect(Math.max(x0, 0) + 1, y + 1, Math.min(w, W) - 2, h - 2);
      }
      hits.push({ i, x: x0, y, w, h });
      if (w > 34) {
        const fill = single >= 0 ? tint(single, lighten) : '#334155';
        ctx.save();
        ctx.beginPath();
        ctx.rect(Math.max(x0, 0), y, Math.min(x1, W) - Math.max(x0, 0), h);
        ctx.clip();
        ctx.fillStyle = single >= 0 ? textColor(fill) : '#ffffff';
        if (single < 0) { ctx.shadowColor = 'rgba(15,23,42,0.55)'; ctx.shadowBlur = 3; }
        const tx = Math.max(x0, 0) + 6;
        const twoLines = h >= 34;
        ctx.font = labelFont;
        ctx.fillText(localName(i), tx, y + (twoLines ? h / 2 - 7 : h / 2));
        if (twoLines) {
          ctx.font = subFont;
          ctx.globalAlpha = 0.85;
          ctx.fillText(className(i) + ' · ' + fmtPct(tot[i] / (tot[0] || 1)), tx, y + h / 2 + 8);
          ctx.globalAlpha = 1;
        }
        ctx.restore();
      }
    }
    drawCuts(X, top, H);
    drawRibbon();
    document.getElementById('map-hint').textContent =
      'sized by ' + state.sizeBy + ' · ' + (f === 0 ? 'click a block to zoom in' : 'click a band to zoom out');
  }
  /** Dashed lines where one stage hands over to the next: the pipeline's cuts, through every level. */
  function drawCuts(X, top, H) {
    const runs = stageRuns(state.focus);
    ctx.save();
    ctx.strokeStyle = 'rgba(15,23,42,0.55)';
    ctx.lineWidth = 1.5;
    ctx.setLineDash([4, 3]);
    for (let k = 1; k < runs.length; k++) {
      const x = Math.round(X(runs[k][0])) + 0.5;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, H);
      ctx.stroke();
    }
    ctx.restore();
  }
  /** The model flattened in call order: exactly the pipeline the partitioner cut. */
  function drawRibbon() {
    const [W, H] = fitCanvas(ribbon, rctx);
    rctx.clearRect(0, 0, W, H);
    const X = (x) => ((x - view.x0) / (view.x1 - view.x0)) * W;
    const runs = stageRuns(state.focus);
    rctx.font = '700 10.5px ' + getComputedStyle(document.body).getPropertyValue('--sans');
    rctx.textBaseline = 'middle';
    for (const [a, b, s] of runs) {
      const x0 = X(a);
      const x1 = X(b);
      rctx.fillStyle = stageColor(s);
      rctx.fillRect(x0, 0, Math.max(x1 - x0, 0.5), H);
      if (x1 - x0 > 46) {
        rctx.fillStyle = '#fff';
        rctx.fillText('stage ' + s, x0 + 6, H / 2);
      }
    }
    const stagesHere = new Set(runs.map((r) => r[2]));
    document.getElementById('ribbon-note').textContent =
      stagesHere.size + ' of ' + state.part.s + ' stage' + (state.part.s > 1 ? 's' : '') + ' in view';
  }
  function zoomTo(f) {
    const tot = sizeTot();
    if (!tot[f]) return;
    state.focus = f;
    const from = { x0: view.x0, x1: view.x1 };
    const to = { x0: pos[f], x1: pos[f] + tot[f] };
    const t0 = performance.now();
    const dur = 380;
    cancelAnimationFrame(anim);
    const stepAnim = (now) => {
      const t = clamp((now - t0) / dur, 0, 1);
      const e = t < 0.5 ? 4 * t * t * t : 1 - Math.pow(-2 * t + 2, 3) / 2;
      view = { x0: from.x0 + (to.x0 - from.x0) * e, x1: from.x1 + (to.x1 - from.x1) * e };
      drawIcicle();
      if (t < 1) anim = requestAnimationFrame(stepAnim);
    };
    anim = requestAnimationFrame(stepAnim);
  }
  function ensureVisibleInMap(i) {
    const tot = sizeTot();
    const f = state.focus;
    const inside = i >= f && i < end[f];
    const wide = (tot[i] / (view.x1 - view.x0)) * canvas.clientWidth >= 40;
    if (inside && wide) return;
    // Zoom to the parent, so the module shows up with its siblings around it.
    let target = Math.max(parentOf[i], 0);
    while (target > 0 && !tot[target]) target = parentOf[target];
    zoomTo(target);
  }
  function hitAt(ev) {
    const r = canvas.getBoundingClientRect();
    const x = ev.clientX - r.left;
    const y = ev.clientY - r.top;
    for (let k = hits.length - 1; k >= 0; k--) {
      const h = hits[k];
      if (x >= h.x && x <= h.x + h.w && y >= h.y && y <= h.y + h.h) return h;
    }
    return null;
  }
  function bindIcicle() {
    canvas.addEventListener('mousemove', (ev) => {
      const h = hitAt(ev);
      const i = h ? h.i : -1;
      if (i !== hover) { hover = i; drawIcicle(); }
      if (h) showTip(ev, nodeTip(i)); else hideTip();
    });
    canvas.addEventListener('mouseleave', () => { hover = -1; hideTip(); drawIcicle(); });
    canvas.addEventListener('click', (ev) => {
      const h = hitAt(ev);
      if (!h) return;
      const i = h.i;
      if (h.band) zoomTo(i);
      else if (i === state.focus && i !== 0) zoomTo(parentOf[i]);
      else if (children[i].length) zoomTo(i);
      select(i, { from: 'map' });
    });
    window.addEventListener('resize', () => { drawIcicle(); if (DATA.timeline) renderTimeline(); });
  }
  function nodeTip(i) {
    const tot = sizeTot();
    const spread = subtreeStages(i, sizeOwn());
    return [
      ['t', displayName(i)],
      ['l', className(i) + (T.calls[i] > 1 ? ' · ×' + T.calls[i] + ' calls' : '')],
      ['l', 'compute ' + fmtCompute(totCompute[i]) + ' (' + fmtPct(totCompute[i] / ALL_COMPUTE) + ')'],
      ['l', 'memory ' + fmtBytes(totMemory[i]) + ' (' + fmtPct(totMemory[i] / ALL_MEMORY) + ')'],
      ['l', 'params ' + fmtCount(totParams[i])],
      ['stages', spread],
      ['l', tot[i] ? '' : 'no ' + state.sizeBy + ' recorded'],
    ];
  }

  // ================================================================ tooltip
  const tip = document.getElementById('tooltip');
  function showTip(ev, lines) {
    const parts = [];
    for (const [kind, value] of lines) {
      if (!value || (Array.isArray(value) && !value.length)) continue;
      if (kind === 'stages') {
        const div = el('div', 'l');
        for (const [s, share] of value) {
          const sw = el('span', 'sw');
          sw.style.background = stageColor(s);
          div.appendChild(sw);
          div.appendChild(document.createTextNode('stage ' + s + (value.length > 1 ? ' ' + fmtPct(share) : '') + '  '));
        }
        parts.push(div);
      } else {
        parts.push(el('div', kind, value));
      }
    }
    tip.replaceChildren(...parts);
    tip.hidden = false;
    const pad = 14;
    const w = tip.offsetWidth;
    const h = tip.offsetHeight;
    let x = ev.clientX + pad;
    let y = ev.clientY + pad;
    if (x + w > window.innerWidth - 8) x = ev.clientX - w - pad;
    if (y + h > window.innerHeight - 8) y = ev.clientY - h - pad;
    tip.style.left = x + 'px';
    tip.style.top = y + 'px';
  }
  function hideTip() { tip.hidden = true; }

  // ================================================================ search
  const searchInput = document.getElementById('search');
  const results = document.getElementById('search-results');
  const searchable = [];
  for (let i = 0; i < N; i++) {
    searchable.push([T.name[i].toLowerCase(), i, T.name[i]]);
    for (const a of aliasesOf(i)) searchable.push([a.toLowerCase(), i, a]);
  }
  let activeResult = 0;
  let currentMatches = [];

  /** Exact names first, then names ending in the query, then prefixes, then anywhere. */
  function findModules(query) {
    const q = query.trim().toLowerCase();
    if (!q) return [];
    const scored = [];
    for (const [low, i, name] of searchable) {
      const at = low.indexOf(q);
      if (at < 0) continue;
      const rank = low === q ? 0 : low.endsWith(q) && (at === 0 || low[at - 1] === '.') ? 1 : at === 0 ? 2 : 3;
      scored.push([rank, name.length, i, name, at]);
    }
    scored.sort((a, b) => a[0] - b[0] || a[1] - b[1] || a[2] - b[2]);
    return scored.slice(0, 40);
  }
  function renderResults() {
    const q = searchInput.value.trim();
    currentMatches = findModules(q);
    activeResult = 0;
    if (!q) { results.hidden = true; return; }
    const items = currentMatches.map(([, , i, name, at], k) => {
      const li = el('li');
      li.setAttribute('role', 'option');
      li.dataset.idx = String(i);
      if (k === activeResult) li.classList.add('active');
      li.appendChild(badge([[state.stage[i], 1]]));
      const nm = el('span', 'nm');
      nm.appendChild(document.createTextNode(name.slice(0, at)));
      nm.appendChild(el('mark', '', name.slice(at, at + q.length)));
      nm.appendChild(document.createTextNode(name.slice(at + q.length)));
      li.appendChild(nm);
      li.appendChild(el('span', 'cl', className(i)));
      li.addEventListener('mousedown', (ev) => { ev.preventDefault(); choose(k); });
      return li;
    });
    if (!items.length) items.push(el('li', 'empty', 'no module matches'));
    results.replaceChildren(...items);
    results.hidden = false;
  }
  function choose(k) {
    const m = currentMatches[k];
    if (!m) return;
    results.hidden = true;
    select(m[2], { from: 'search' });
  }
  function bindSearch() {
    searchInput.addEventListener('input', renderResults);
    searchInput.addEventListener('focus', () => { if (searchInput.value.trim()) renderResults(); });
    searchInput.addEventListener('blur', () => { results.hidden = true; });
    searchInput.addEventListener('keydown', (ev) => {
      if (ev.key === 'Enter') { ev.preventDefault(); if (!currentMatches.length) renderResults(); choose(activeResult); }
      else if (ev.key === 'Escape') { results.hidden = true; searchInput.blur(); }
      else if (ev.key === 'ArrowDown' || ev.key === 'ArrowUp') {
        ev.preventDefault();
        const n = currentMatches.length;
        if (!n) return;
        activeResult = (activeResult + (ev.key === 'ArrowDown' ? 1 : n - 1)) % n;
        [...results.children].forEach((li, k) => li.classList.toggle('active', k === activeResult));
        results.children[activeResult].scrollIntoView({ block: 'nearest' });
      }
    });
    document.addEventListener('keydown', (ev) => {
      if (ev.key === '/' && document.activeElement !== searchInput) { ev.preventDefault(); searchInput.focus(); }
    });
  }

  // ================================================================ timeline (SVG)
  function renderTimeline() {
    const TL = DATA.timeline;
    const card = document.getElementById('timeline-card');
    if (!TL || !TL.events.length) { card.hidden = true; return; }
    card.hidden = false;
    const box = document.getElementById('timeline');
    const events = TL.events;
    const kinds = TL.kinds;
    const S = Math.max(...events.map((e) => e[0])) + 1;
    const tEnd = Math.max(TL.span || 0, ...events.map((e) => e[4])) || 1;
    const W = Math.max(box.clientWidth, 320);
    const left = 70;
    const right = 76;
    const laneH = 28;
    const top = 6;
    const H = top + S * laneH + 24;
    const X = (t) => left + (t / tEnd) * (W - left - right);
    const root = svg('svg', { viewBox: '0 0 ' + W + ' ' + H, width: W, height: H, role: 'img' });
    const defs = svg('defs', {});
    const pat = svg('pattern', { id: 'bubble', width: 6, height: 6, patternUnits: 'userSpaceOnUse',
      patternTransform: 'rotate(45)' });
    pat.appendChild(svg('rect', { width: 6, height: 6, fill: '#f8fafc' }));
    pat.appendChild(svg('line', { x1: 0, y1: 0, x2: 0, y2: 6, stroke: '#e2e8f0', 'stroke-width': 3 }));
    defs.appendChild(pat);
    root.appendChild(defs);
    const busy = new Float64Array(S);
    for (const e of events) busy[e[0]] += e[4] - e[3];
    for (let s = 0; s < S; s++) {
      const g = svg('g', { class: 'tl-row', 'data-stage': s });
      const y = top + s * laneH;
      g.appendChild(svg('rect', { x: left, y: y + 2, width: W - left - right, height: laneH - 4, rx: 4, fill: 'url(#bubble)' }));
      const label = svg('text', { x: 8, y: y + laneH / 2 + 4, class: 'lane-label' });
      label.textContent = 'stage ' + s;
      g.appendChild(label);
      const util = svg('text', { x: W - right + 8, y: y + laneH / 2 + 4, class: 'busy' });
      util.textContent = 'busy ' + fmtPct(busy[s] / tEnd);
      g.appendChild(util);
      root.appendChild(g);
    }
    const rowsG = root.querySelectorAll('.tl-row');
    for (const [s, mb, k, a, b] of events) {
      const kind = kinds[k];
      const y = top + s * laneH;
      const x0 = X(a);
      const w = Math.max(X(b) - x0, 1);
      const fill = kind === 'forward' ? stageColor(s) : kind === 'backward' ? shade(s, 0.3) : '#94a3b8';
      const r = svg('rect', { x: x0, y: y + 3, width: w, height: laneH - 6, rx: 3, fill, class: 'blk' });
      r.dataset.kind = kind;
      r.addEventListener('mousemove', (ev) => showTip(ev, [
        ['t', 'stage ' + s + ' · micro-batch ' + mb + ' · ' + kind],
        ['l', fmtSeconds(a) + ' → ' + fmtSeconds(b) + '  (' + fmtSeconds(b - a) + ')'],
      ]));
      r.addEventListener('mouseleave', hideTip);
      rowsG[s].appendChild(r);
      const text = (kind === 'backward' ? 'b' : kind === 'forward' ? 'f' : '') + mb;
      if (w > text.length * 6.5 + 4) {
        const t = svg('text', { x: x0 + w / 2, y: y + laneH / 2 + 3.5, 'text-anchor': 'middle', class: 'mb' });
        t.textContent = text;
        rowsG[s].appendChild(t);
      }
    }
    const axis = svg('g', { class: 'axis' });
    const ticks = 6;
    for (let k = 0; k <= ticks; k++) {
      const t = (tEnd * k) / ticks;
      const x = X(t);
      axis.appendChild(svg('line', { x1: x, x2: x, y1: top, y2: top + S * laneH + 2 }));
      const label = svg('text', { x, y: top + S * laneH + 16, 'text-anchor': k === 0 ? 'start' : k === ticks ? 'end' : 'middle' });
      label.textContent = fmtSeconds(t);
      axis.appendChild(label);
    }
    root.insertBefore(axis, root.querySelector('.tl-row'));
    const total = busy.reduce((x, y) => x + y, 0);
    const bubble = 1 - total / (S * tEnd);
    const summary = el('div', 'summary', (TL.schedule ? TL.schedule + ' schedule · ' : '') + S + ' stages · ' +
      new Set(events.map((e) => e[1])).size +
      ' micro-batches · step ' + fmtSeconds(tEnd) + ' · bubble ' + fmtPct(bubble) + ' of stage time');
    box.replaceChildren(root, summary);
    const legend = document.getElementById('timeline-legend');
    const item = (color, text, pattern) => {
      const it = el('span', 'item');
      const sw = el('span', 'sw');
      sw.style.background = pattern ? 'repeating-linear-gradient(45deg,#f8fafc 0 2px,#e2e8f0 2px 4px)' : color;
      it.appendChild(sw);
      it.appendChild(document.createTextNode(text));
      return it;
    };
    legend.replaceChildren(item(stageColor(0), 'forward'), item(shade(0, 0.3), 'backward'), item('', 'bubble (idle)', true));
  }

  // ================================================================ plans table
  function fmtCell(value, fmt) {
    if (value === null || value === undefined) return '–';
    if (Array.isArray(value)) return 'max ' + fmtCell(Math.max(...value), fmt);
    if (typeof value === 'boolean') return value ? 'yes' : 'no';
    if (typeof value !== 'number') return String(value);
    if (fmt === 'bytes') return fmtBytes(value);
    if (fmt === 'seconds') return fmtSeconds(value);
    return Number.isInteger(value) ? String(value) : value.toPrecision(4);
  }
  function sortKey(value) {
    if (Array.isArray(value)) return Math.max(...value);
    return value;
  }
  function renderPlans() {
    const P = DATA.plans;
    const card = document.getElementById('plans-card');
    if (!P || !P.rows.length) { card.hidden = true; return; }
    card.hidden = false;
    const table = document.getElementById('plans');
    const thead = el('thead');
    const hr = el('tr');
    const tbody = el('tbody');
    const rowEls = P.rows.map((r, k) => {
      const tr = el('tr', k === 0 ? 'best' : '');
      tr.dataset.rank = String(k);
      r.forEach((v, c) => tr.appendChild(planCell(v, P.columns[c].fmt)));
      return [r, tr];
    });
    let sorted = { col: -1, dir: 1 };
    P.columns.forEach((col, c) => {
      const th = el('th', '', prettyKey(col.key));
      th.title = col.key;
      th.dataset.key = col.key;
      th.tabIndex = 0;
      const sortBy = () => {
        const dir = sorted.col === c ? -sorted.dir : 1;
        sorted = { col: c, dir };
        const order = rowEls.slice().sort((A, B) => {
          const a = sortKey(A[0][c]);
          const b = sortKey(B[0][c]);
          if (a === b) return 0;
          if (a === null || a === undefined) return 1;
          if (b === null || b === undefined) return -1;
          return (a < b ? -1 : 1) * dir;
        });
        tbody.replaceChildren(...order.map((x) => x[1]));
        for (const h of hr.children) h.removeAttribute('aria-sort');
        th.setAttribute('aria-sort', dir > 0 ? 'ascending' : 'descending');
      };
      th.addEventListener('click', sortBy);
      th.addEventListener('keydown', (ev) => { if (ev.key === 'Enter') sortBy(); });
      hr.appendChild(th);
    });
    thead.appendChild(hr);
    tbody.replaceChildren(...rowEls.map((x) => x[1]));
    table.replaceChildren(thead, tbody);
    const notes = document.getElementById('plan-notes');
    notes.replaceChildren(...(P.notes || []).map((n) => el('li', '', n)));
    notes.hidden = !(P.notes && P.notes.length);
  }
  /** "stages.memory_bytes" -> "stage memory": the unit shows in the cells. */
  function prettyKey(key) {
    return key.replace(/^stages\./, 'stage ').replace(/^config\./, '').replace(/_(s|bytes)$/, '').replace(/_/g, ' ');
  }
  /** A number, or for a per-stage list a little bar per stage and the largest value. */
  function planCell(value, fmt) {
    const td = el('td');
    if (!Array.isArray(value) || value.length < 2) {
      td.textContent = Array.isArray(value) ? fmtCell(value[0], fmt) : fmtCell(value, fmt);
      return td;
    }
    const mx = Math.max(...value) || 1;
    const spark = el('span', 'spark' + (value.length > 16 ? ' dense' : ''));
    value.forEach((x, s) => {
      const bar = el('i');
      bar.style.height = clamp(x / mx * 100, 6, 100).toFixed(0) + '%';
      spark.appendChild(bar);
    });
    td.appendChild(spark);
    td.appendChild(el('span', '', fmtCell(mx, fmt)));
    td.title = value.map((x, s) => 'stage ' + s + ': ' + fmtCell(x, fmt)).join('\n');
    return td;
  }

  // ================================================================ start
  renderHeader();
  renderControls();
  renderTree();
  renderLegend();
  layoutIcicle();
  bindIcicle();
  bindSearch();
  renderStageBars();
  drawIcicle();
  renderTimeline();
  renderPlans();
  select(0, { from: 'tree' });
  document.body.dataset.ready = 'true';
})();
