// The Overview page: a heatmap of every GPU (colour: memory used) and the node list, kept current by
// the /ws/cluster/ websocket without reloading. Rows are the atomic blocks (GPUs that may form one
// TP group; scheduler.topology.partition, sent by /ws/gearbox/ through overview.js), then per node
// the GPUs that are in no block, with why; until the blocks are known (or for a user who may not
// read the gearbox) rows are nodes and columns GPU indexes.
// A delta that only changes GPUs and nodes already drawn patches their cells (Plotly.restyle of the
// trace's z, text and hover data, edited in place at the cells' indices) and their node rows; a
// snapshot, a new GPU or node, or new blocks and holders redraw everything (Plotly.react).
// `FlexPipe.cluster.draws` counts both (the browser test reads it).
(function () {
  "use strict";
  const state = { nodes: {}, gpus: {}, blocks: null, holders: {}, twu: {},
                  draws: { full: 0, patches: 0, cells: 0 } };
  // from the last full draw: each GPU's cell ({r, c, where}) and each node's GPUs
  let cells = null, nodeGpus = {};
  const heartbeatTimeout = JSON.parse(document.getElementById("heartbeat-timeout").textContent);
  window.FlexPipe = window.FlexPipe || {};
  window.FlexPipe.cluster = state;

  function gib(bytes) { return bytes == null ? "?" : (bytes / 2 ** 30).toFixed(1) + " GiB"; }
  function pct(x) { return x == null ? "?" : Math.round(x * 100) + "%"; }

  function gpuStatus(g, node) {
    if (!g.healthy) return "unhealthy (XID " + g.xid_errors + ", ECC " + g.ecc_errors + ")";
    if (node && !node.schedulable) return "node unschedulable";
    if (!g.allocatable) return "held by another tenant";
    return "ok";
  }

  function apply(msg) {
    if (msg.type === "snapshot") { state.nodes = {}; state.gpus = {}; cells = null; }
    const nodes = msg.nodes || [], gpus = msg.gpus || [];
    // a cell can be patched when its GPU is drawn already, where it will stay
    const patchable = msg.type === "delta" && cells !== null &&
      nodes.every(function (n) { return state.nodes[n.node_id]; }) &&
      gpus.every(function (g) {
        const old = state.gpus[g.uuid];
        return old && cells[g.uuid] && old.node_id === g.node_id && old.index === g.index;
      });
    nodes.forEach(function (n) { state.nodes[n.node_id] = n; });
    gpus.forEach(function (g) { state.gpus[g.uuid] = g; });
    if (patchable) patch(nodes, gpus); else render();
  }

  function patch(nodes, gpus) {
    const touched = {}, rows = {};
    gpus.forEach(function (g) { touched[g.uuid] = true; rows[g.node_id] = true; });
    // a node's state shows in its GPUs' cells (unschedulable: "?")
    nodes.forEach(function (n) { rows[n.node_id] = true; (nodeGpus[n.node_id] || []).forEach(function (u) { touched[u] = true; }); });
    patchCells(Object.keys(touched), Object.keys(rows));
  }

  // redraw the cells of these GPUs and the table rows of these nodes, nothing else
  function patchCells(uuids, nodeIds) {
    const el = document.getElementById("heatmap");
    const trace = el.data && el.data[0];
    if (!trace) { render(); return; }
    let n = 0;
    uuids.forEach(function (u) {
      const at = cells[u], g = state.gpus[u];
      if (!at || !g) return;
      const c = cellFor(g, at.where(g));
      trace.z[at.r][at.c] = c.z; trace.text[at.r][at.c] = c.text; trace.customdata[at.r][at.c] = c.custom;
      n += 1;
    });
    if (n) Plotly.restyle(el, { z: [trace.z], text: [trace.text], customdata: [trace.customdata] }, [0]);
    state.draws.patches += 1;
    state.draws.cells += n;
    nodeIds.forEach(function (id) {
      const tr = document.querySelector('#nodes tbody tr[data-node="' + CSS.escape(id) + '"]');
      if (tr && state.nodes[id]) tr.replaceWith(nodeRow(id));
    });
    updateAges();
  }

  // token-weighted utilisation (scheduler/pool/twu.py): "—" where no plan on the GPU reported
  function twuText(g) { const v = state.twu[g.uuid]; return v == null ? "—" : v.toFixed(2); }

  function holderText(g) {
    const held = state.holders[g.uuid] || [];
    return held.length ? held.map(function (h) {
      if (h.job) return "job " + h.job + (h.role === "yielding" ? " (yielding: checkpointing)" : "");  // scheduler/pool/jobs.py
      return h.deployment + " " + h.plan + " stage " + h.stage + (h.role === "preparing" ? " (preparing)" : "");
    }).join("; ") : "—";
  }

  function cellFor(g, where) {
    const node = state.nodes[g.node_id];
    const used = g.mem_used_bytes == null ? null : g.mem_used_bytes / g.mem_total_bytes;
    const flag = !g.healthy ? "✕" : (node && !node.schedulable ? "?" : (!g.allocatable ? "T" : ""));
    const held = state.holders[g.uuid] || [];
    const mark = held.some(function (h) { return h.role === "serving"; }) ? "●"
      : (held.some(function (h) { return h.job; }) ? "J" : (held.length ? "◐" : ""));
    return { z: used, text: flag || mark,
             custom: [g.uuid, g.model, gib(g.mem_used_bytes) + " / " + gib(g.mem_total_bytes), pct(g.sm_util),
                      gpuStatus(g, node), g.temperature_c == null ? "?" : g.temperature_c + " °C", where,
                      holderText(g), g.node_id, g.index, twuText(g)] };
  }

  // rows: [{label, gpus: [gpu, ...], where: text}] - by block when known, else by node
  function layout() {
    const gpus = Object.values(state.gpus);
    if (!state.blocks) {
      return Object.keys(state.nodes).sort().map(function (id) {
        const row = [];
        gpus.filter(function (g) { return g.node_id === id; }).forEach(function (g) { row[g.index] = g; });
        return { label: id, gpus: row, where: function () { return "node " + id; } };
      });
    }
    const rows = [];
    const placed = {};
    state.blocks.blocks.forEach(function (b) {
      const row = b.gpus.map(function (u) { placed[u] = true; return state.gpus[u]; }).filter(Boolean);
      rows.push({ label: b.id + " · " + b.gpu_model, gpus: row, block: b.id,
                  where: function () { return "block " + b.id + " (" + b.link + ", " + b.gpus.length + " GPUs)"; } });
    });
    Object.keys(state.nodes).sort().forEach(function (id) {
      const out = gpus.filter(function (g) { return g.node_id === id && !placed[g.uuid]; })
                      .sort(function (a, b) { return a.index - b.index; });
      if (out.length) {
        rows.push({ label: id + " · out", gpus: out, where: function (g) {
          return "in no block: " + (state.blocks.excluded[g.uuid] || "not in the snapshot"); } });
      }
    });
    return rows;
  }

  function render() {
    const rows = layout();
    const gpus = Object.values(state.gpus);
    // one column per GPU index: a block's GPUs (all on one node) sit under their own index
    const width = Math.max(1, ...gpus.map(function (g) { return g.index + 1; }));
    const z = [], text = [], custom = [];
    cells = {};
    nodeGpus = {};
    rows.forEach(function (r, ri) {
      const rowZ = new Array(width).fill(null), rowT = new Array(width).fill(""), rowC = new Array(width).fill(null);
      r.gpus.forEach(function (g) {
        if (!g) return;
        const c = cellFor(g, r.where(g));
        rowZ[g.index] = c.z; rowT[g.index] = c.text; rowC[g.index] = c.custom;
        cells[g.uuid] = { r: ri, c: g.index, where: r.where };
        (nodeGpus[g.node_id] = nodeGpus[g.node_id] || []).push(g.uuid);
      });
      z.push(rowZ); text.push(rowT); custom.push(rowC);
    });
    const byBlock = !!state.blocks;
    const trace = {
      type: "heatmap", z: z, y: rows.map(function (r) { return r.label; }),
      x: Array.from({ length: width }, function (_, i) { return "GPU " + i; }),
      text: text, texttemplate: "%{text}", customdata: custom, zmin: 0, zmax: 1, xgap: 3, ygap: 3,
      colorscale: "YlOrRd", reversescale: true, colorbar: { title: { text: "memory used" }, tickformat: ".0%" },
      hovertemplate: "<b>%{customdata[8]} · GPU %{customdata[9]}</b><br>%{customdata[1]}<br>memory %{customdata[2]}" +
                     "<br>utilisation %{customdata[3]} · TWU %{customdata[10]}<br>%{customdata[4]}<br>%{customdata[5]}<br>%{customdata[6]}" +
                     "<br>runs: %{customdata[7]}<extra></extra>",
    };
    const el = document.getElementById("heatmap");
    Plotly.react(el, [trace], {
      margin: { l: 20, r: 20, t: 36, b: 10 }, height: Math.max(220, 36 * rows.length + 80),
      yaxis: { autorange: "reversed", type: "category", automargin: true },  // labels never clipped
      xaxis: { side: "top", type: "category" },
    }, { displaylogo: false, responsive: true });
    state.draws.full += 1;
    el.dataset.gpuCount = String(gpus.length);
    el.dataset.grouping = byBlock ? "block" : "node";
    el.dataset.rows = String(rows.length);
    renderNodes(Object.keys(state.nodes).sort());
  }

  // what the layout draws of the blocks (rows, labels, the GPUs out and why): a block's free memory
  // moves with every report and is drawn by the cells themselves, so it is no reason to redraw
  function blockShape(b) {
    if (!b) return "null";
    return JSON.stringify([(b.blocks || []).map(function (x) { return [x.id, x.gpu_model, x.link, x.gpus]; }),
                           b.excluded || {}, b.fleet_error || null]);
  }

  // the uuids whose value differs between two {uuid: value} maps, added to `into`
  function changedKeys(a, b, into) {
    Object.keys(a).concat(Object.keys(b)).forEach(function (k) {
      if (JSON.stringify(a[k]) !== JSON.stringify(b[k])) into[k] = true;
    });
  }

  // overview.js hands over the blocks, what runs where and each GPU's TWU, from /ws/gearbox/ (after
  // every fleet push): new blocks redraw the heatmap, new holders or TWU patch the cells they change
  state.setGearbox = function (blocks, holders, twu) {
    let full = cells === null;
    const changed = {};
    if (blocks !== undefined) {
      full = full || blockShape(blocks) !== blockShape(state.blocks);
      state.blocks = blocks;
    }
    if (holders !== undefined) { changedKeys(state.holders, holders || {}, changed); state.holders = holders || {}; }
    if (twu !== undefined) { changedKeys(state.twu, twu || {}, changed); state.twu = twu || {}; }
    if (full) { render(); return; }
    const uuids = Object.keys(changed).filter(function (u) { return cells[u]; });
    if (uuids.length) patchCells(uuids, []);
  };

  function nodeRow(id) {
    const n = state.nodes[id];
    const gs = (nodeGpus[id] || []).map(function (u) { return state.gpus[u]; });
    const tr = document.createElement("tr");
    tr.dataset.node = id;
    const tds = [id, n.rack || "—", gs.length,
                 gs.filter(function (g) { return g.allocatable && g.healthy; }).length,
                 gs.filter(function (g) { return g.healthy; }).length,
                 n.schedulable ? "schedulable" : ("unschedulable: " + n.unschedulable_reason), ""];
    tds.forEach(function (c, i) {
      const td = document.createElement("td");
      td.textContent = c;
      if (i === 5) td.className = n.schedulable ? "ok" : "bad";
      if (i === 6) { td.className = "age"; td.dataset.since = n.last_seen_at || ""; }
      tr.appendChild(td);
    });
    return tr;
  }

  function renderNodes(nodeIds) {
    const tbody = document.querySelector("#nodes tbody");
    tbody.innerHTML = "";
    nodeIds.forEach(function (id) { tbody.appendChild(nodeRow(id)); });
    updateAges();
  }

  function updateAges() {
    document.querySelectorAll("#nodes td.age").forEach(function (td) {
      if (!td.dataset.since) { td.textContent = "never"; return; }
      const s = Math.max(0, (Date.now() - Date.parse(td.dataset.since)) / 1000);
      td.textContent = s < 1 ? "just now" : Math.round(s) + " s ago";
      td.classList.toggle("bad", s > heartbeatTimeout);
    });
  }
  setInterval(updateAges, 1000);

  window.FlexPipe.live.connect("/ws/cluster/", apply, document.getElementById("live-status"));
})();
