// The Overview page: a heatmap of every GPU (rows: nodes, columns: GPU index, colour: memory
// used) and the node list, kept current by the /ws/cluster/ websocket without reloading.
(function () {
  "use strict";
  const state = { nodes: {}, gpus: {} };
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
    if (msg.type === "snapshot") { state.nodes = {}; state.gpus = {}; }
    (msg.nodes || []).forEach(function (n) { state.nodes[n.node_id] = n; });
    (msg.gpus || []).forEach(function (g) { state.gpus[g.uuid] = g; });
    render();
  }

  function render() {
    const nodeIds = Object.keys(state.nodes).sort();
    const gpus = Object.values(state.gpus);
    const width = Math.max(1, ...gpus.map(function (g) { return g.index + 1; }));
    const z = [], text = [], custom = [];
    nodeIds.forEach(function (id) {
      const rowZ = new Array(width).fill(null), rowT = new Array(width).fill(""), rowC = new Array(width).fill(null);
      gpus.filter(function (g) { return g.node_id === id; }).forEach(function (g) {
        const node = state.nodes[id];
        const used = g.mem_used_bytes == null ? null : g.mem_used_bytes / g.mem_total_bytes;
        rowZ[g.index] = used;
        rowT[g.index] = !g.healthy ? "✕" : (!node.schedulable ? "?" : (!g.allocatable ? "T" : ""));
        rowC[g.index] = [g.uuid, g.model, gib(g.mem_used_bytes) + " / " + gib(g.mem_total_bytes),
                         pct(g.sm_util), gpuStatus(g, node), g.temperature_c == null ? "?" : g.temperature_c + " °C"];
      });
      z.push(rowZ); text.push(rowT); custom.push(rowC);
    });
    const trace = {
      type: "heatmap", z: z, x: Array.from({ length: width }, function (_, i) { return "GPU " + i; }), y: nodeIds,
      text: text, texttemplate: "%{text}", customdata: custom, zmin: 0, zmax: 1, xgap: 3, ygap: 3,
      colorscale: "YlOrRd", reversescale: true, colorbar: { title: { text: "memory used" }, tickformat: ".0%" },
      hovertemplate: "<b>%{y} · %{x}</b><br>%{customdata[1]}<br>memory %{customdata[2]}" +
                     "<br>utilisation %{customdata[3]}<br>%{customdata[4]}<br>%{customdata[5]}<extra></extra>",
    };
    const el = document.getElementById("heatmap");
    Plotly.react(el, [trace], {
      margin: { l: 90, r: 20, t: 36, b: 10 }, height: Math.max(220, 36 * nodeIds.length + 80),
      yaxis: { autorange: "reversed", type: "category" }, xaxis: { side: "top" },
    }, { displaylogo: false, responsive: true });
    el.dataset.gpuCount = String(gpus.length);
    renderNodes(nodeIds);
  }

  function renderNodes(nodeIds) {
    const tbody = document.querySelector("#nodes tbody");
    tbody.innerHTML = "";
    nodeIds.forEach(function (id) {
      const n = state.nodes[id];
      const gs = Object.values(state.gpus).filter(function (g) { return g.node_id === id; });
      const tr = document.createElement("tr");
      tr.dataset.node = id;
      const cells = [id, n.rack || "—", gs.length,
                     gs.filter(function (g) { return g.allocatable && g.healthy; }).length,
                     gs.filter(function (g) { return g.healthy; }).length,
                     n.schedulable ? "schedulable" : ("unschedulable: " + n.unschedulable_reason), ""];
      cells.forEach(function (c, i) {
        const td = document.createElement("td");
        td.textContent = c;
        if (i === 5) td.className = n.schedulable ? "ok" : "bad";
        if (i === 6) { td.className = "age"; td.dataset.since = n.last_seen_at || ""; }
        tr.appendChild(td);
      });
      tbody.appendChild(tr);
    });
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
