// The live page of `pgcascade serve`: polls /api/topology and draws it.  No framework and no
// network beyond this server; every text from the databases goes in through textContent.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let refreshMs = 2000;

function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svg(tag, attrs = {}, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function seconds(s) {
  if (s === null || s === undefined) return "-";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function health(node) {
  const r = node.report;
  if (!r || r.last_error || r.provider_reachable === false) return "bad";
  if ((r.daemons || []).some((d) => d.critical)) return "bad";
  if (r.paused || (r.lag_seconds !== undefined && r.lag_seconds !== null && r.lag_seconds > 10)) return "late";
  if (r.copies && r.copies.length) return "late";
  return "ok";
}

function nodeSummary(node) {
  const r = node.report;
  if (!r) return node.dead ? "dead" : "unreachable";
  const down = (r.daemons || []).filter((d) => d.critical).map((d) => d.role);
  if (down.length) return `${down.join(", ")} not running`;
  if (r.type === "root") return `tick ${r.queue ? r.queue.last_tick : "-"}`;
  const parts = [`lag ${seconds(r.lag_seconds)}`];
  if (r.paused) parts.push("paused");
  return parts.join(", ");
}

// Depth by following providers; nodes of one depth side by side, providers' arrows downward.
function layout(nodes) {
  const byName = new Map(nodes.map((n) => [n.name, n]));
  const depth = new Map();
  const depthOf = (n, seen = new Set()) => {
    if (depth.has(n.name)) return depth.get(n.name);
    const p = n.provider && byName.get(n.provider);
    const d = !p || seen.has(n.name) ? 0 : depthOf(p, new Set([...seen, n.name])) + 1;
    depth.set(n.name, d);
    return d;
  };
  nodes.forEach((n) => depthOf(n));
  const levels = [];
  for (const n of nodes) (levels[depth.get(n.name)] ||= []).push(n);
  return { byName, depth, levels };
}

function drawGraph(topo) {
  const g = document.getElementById("graph");
  g.replaceChildren();
  const defs = svg("defs");
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 8, markerHeight: 8, orient: "auto-start-reverse" });
  marker.append(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#6c7a89" }));
  defs.append(marker);
  g.append(defs);
  const { byName, levels } = layout(topo.nodes);
  const width = g.clientWidth || 800;
  const boxW = 170, boxH = 48, rowH = 90;
  g.setAttribute("height", Math.max(120, levels.length * rowH + 20));
  const pos = new Map();
  levels.forEach((level, d) => {
    level.forEach((n, i) => pos.set(n.name, { x: ((i + 1) * width) / (level.length + 1), y: 20 + d * rowH }));
  });
  for (const n of topo.nodes) {
    const p = n.provider && pos.get(n.provider);
    if (!p || !byName.has(n.provider)) continue;
    const c = pos.get(n.name);
    g.append(svg("path", { class: "edge", "data-edge": `${n.provider}->${n.name}`, d: `M ${p.x} ${p.y + boxH} L ${c.x} ${c.y}` }));
  }
  for (const n of topo.nodes) {
    const { x, y } = pos.get(n.name);
    const grp = svg("g", { class: `node ${health(n)}`, "data-node": n.name, transform: `translate(${x - boxW / 2},${y})` });
    grp.append(svg("rect", { width: boxW, height: boxH }));
    grp.append(svg("text", { x: boxW / 2, y: 19 }, `${n.name} (${n.type ?? "?"})`));
    grp.append(svg("text", { x: boxW / 2, y: 37, class: "sub", "data-testid": `graph-lag-${n.name}` }, nodeSummary(n)));
    g.append(grp);
  }
}

function tablesTable(r) {
  const t = el("table", { "data-testid": `tables-${r.node}` });
  const head = el("tr");
  const cols = r.type === "root" ? ["table", "key", "format"] : ["table", "state", "lag", "waiting", "copy"];
  cols.forEach((c) => head.append(el("th", {}, c)));
  t.append(head);
  const copies = new Map((r.copies || []).map((c) => [c.table, c]));
  for (const row of r.tables) {
    const tr = el("tr", { "data-table": row.table });
    tr.append(el("td", {}, row.table));
    if (r.type === "root") {
      tr.append(el("td", {}, (row.key || []).join(", ")), el("td", {}, row.format));
    } else {
      tr.append(el("td", { class: row.phase === "ok" ? "state-ok" : "state-copy", "data-testid": "state" }, row.state));
      tr.append(el("td", { class: "num", "data-testid": "lag" }, seconds(row.lag_seconds)));
      tr.append(el("td", { class: "num" }, row.pending_events ?? "-"));
      tr.append(copyCell(copies.get(row.table)));
    }
    t.append(tr);
  }
  return t;
}

function copyCell(c) {
  const td = el("td", { "data-testid": "copy" });
  if (!c) return td;
  const bar = el("span", { class: "bar" });
  bar.append(el("span", { style: `width:${c.percent ?? 0}%` }));
  const total = c.rows_total === null ? "?" : c.rows_total;
  const pct = c.percent === null ? "" : ` ${c.percent.toFixed(0)}%`;
  td.append(bar, el("span", {}, ` ${c.step}: ${c.rows}/${total} rows${pct}, ETA ${seconds(c.eta)}`));
  if (c.ranges) td.append(el("span", {}, `, ${c.ranges_done}/${c.ranges} ranges`));
  return td;
}

function daemonFact(d) {
  if (d.running) return `${d.role}: running`;
  if (d.last_seen === null) return `${d.role}: not running (never started here)`;
  return `${d.role}: not running (last seen ${seconds(d.last_seen_seconds)} ago)`;
}

function nodeCard(n) {
  const card = el("div", { class: "card", "data-testid": `node-${n.name}` });
  card.append(el("h3", {}, `${n.name} - ${n.type ?? "?"}${n.provider ? ` under ${n.provider}` : ""}`));
  const r = n.report;
  const facts = el("div", { class: "facts" });
  if (!r) {
    facts.textContent = `${n.dead ? "dead" : "unreachable"}: ${n.error ?? ""} (${n.location})`;
    card.append(facts);
    return card;
  }
  const parts = [`tick ${(r.type === "root" && r.queue ? r.queue.last_tick : r.last_tick) ?? "-"}`];
  if (r.type !== "root") {
    parts.push(`lag ${seconds(r.lag_seconds)}`, `${r.ticks_behind ?? "?"} ticks behind`);
  }
  if (r.queue) parts.push(`queue keeps ${r.queue.retained_events} events`);
  if (r.capture) parts.push(`capture: ${r.capture.mode}`);
  if (r.paused) parts.push("paused");
  for (const d of r.daemons || []) parts.push(daemonFact(d));
  parts.push(`tables: ${Object.entries(r.tables_per_state).map(([s, k]) => `${s} ${k}`).join(", ") || "none"}`);
  facts.append(el("span", { "data-testid": `facts-${n.name}` }, parts.join(" | ")));
  card.append(facts, tablesTable(r));
  return card;
}

function render(topo) {
  refreshMs = Math.max(200, (topo.refresh_seconds || 2) * 1000);
  document.getElementById("set-name").textContent = `set ${topo.set}`;
  const when = new Date(topo.generated_at).toLocaleTimeString();
  document.getElementById("updated").textContent =
    `read ${when}` + (topo.reading_error ? ` - last reading failed: ${topo.reading_error}` : "");
  drawGraph(topo);
  const errors = document.getElementById("errors");
  errors.replaceChildren();
  if (!topo.errors.length) errors.append(el("li", { class: "none" }, "none"));
  for (const e of topo.errors.slice(0, 20)) {
    errors.append(el("li", {}, `${e.node} (${e.kind}${e.time ? `, ${e.time}` : ""}): ${e.message}`));
  }
  document.getElementById("nodes").replaceChildren(...topo.nodes.map(nodeCard));
}

async function poll() {
  try {
    const res = await fetch("/api/topology", { cache: "no-store" });
    const body = await res.json();
    if (res.ok) render(body);
    else document.getElementById("updated").textContent = `waiting: ${body.error}`;
  } catch (err) {
    document.getElementById("updated").textContent = `server not answering (${err})`;
  }
  setTimeout(poll, refreshMs);
}

poll();
