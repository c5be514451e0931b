// Shared pieces of the gearbox pages (Deployments, Deployment, review, Overview): formatting, the
// operator's POSTs (with the CSRF token), the switch timeline as a Gantt of phases, the gear
// diagram (stages on GPUs) and the deployments table. Each page script uses FlexPipe.gb.
(function () {
  "use strict";
  const PHASE_COLORS = { prepare: "#7c8cf0", switch: "#f0a23c", cleanup: "#46a86b", rollback: "#d0533f",
                         done: "#46a86b", rolled_back: "#d0533f" };
  const HEALTH_PILL = { ok: "pill-ok", switching: "pill-wait", degraded: "pill-bad", idle: "pill-off", "scaled to zero": "pill-off" };
  const MODE_PILL = { auto: "pill-ok", advisory: "pill-wait", pinned: "pill-pin", emergency: "pill-emergency" };
  const STAGE_COLORS = ["#3451b2", "#e07b39", "#2f9e6e", "#b8408a", "#8a6d1f", "#4f9fd8", "#c23b3b", "#6b5bd2"];

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    Object.entries(attrs || {}).forEach(function ([k, v]) {
      if (v === null || v === undefined) return;
      if (k === "className") node.className = v;
      else if (k.startsWith("data-")) node.setAttribute(k, v);
      else node[k] = v;
    });
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function csrf() {
    const input = document.querySelector("[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  // POST JSON to the API as the logged-in user; resolves to {status, body}.
  function post(url, body) {
    return fetch(url, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", Accept: "application/json", "X-CSRFToken": csrf() },
      body: JSON.stringify(body || {}),
    }).then(function (r) {
      return r.json().catch(function () { return {}; }).then(function (j) { return { status: r.status, body: j }; });
    });
  }

  // DRF's error shapes ({field: [reasons]} or {detail}) as one line that names each field.
  function errorText(body) {
    if (!body) return "failed";
    if (body.detail) return body.detail;
    return Object.keys(body).map(function (k) {
      const v = body[k];
      return k + ": " + (Array.isArray(v) ? v.join("; ") : (typeof v === "object" ? JSON.stringify(v) : v));
    }).join(" · ");
  }

  // A span in words: "4 min 12 s", "2 h 5 min", "850 ms".
  function span(s) {
    s = Math.abs(s);
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 60) return (s < 10 ? s.toFixed(1) : Math.round(s)) + " s";
    const m = Math.floor(s / 60), r = Math.round(s % 60);
    if (m < 60) return m + " min" + (r ? " " + r + " s" : "");
    const h = Math.floor(m / 60);
    return h + " h" + (m % 60 ? " " + (m % 60) + " min" : "");
  }
  // A moment relative to now: "in 4 min 12 s" or "3 min ago"; the UTC time goes in the title.
  function relative(iso, now) {
    if (!iso) return "—";
    const d = (Date.parse(iso) - (now || Date.now())) / 1000;
    return Math.abs(d) < 1 ? "now" : d > 0 ? "in " + span(d) : span(d) + " ago";
  }
  function timeEl(iso, tag) {
    const node = el(tag || "span", { className: "when", title: when(iso) }, relative(iso));
    if (iso) node.dataset.at = iso;
    return node;
  }
  // Every relative time on the page, once a second (they are spans in words, so they age).
  setInterval(function () {
    document.querySelectorAll(".when[data-at]").forEach(function (n) { n.textContent = relative(n.dataset.at); });
  }, 1000);

  function when(iso) { return iso ? iso.replace("T", " ").replace(/\.\d+/, "").replace(/(\+00:00|Z)$/, "Z") : "—"; }
  function clock(iso) { return iso ? when(iso).slice(11, 19) : "—"; }
  function secs(s) {
    if (s === null || s === undefined) return "—";
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 120) return s.toFixed(1) + " s";
    return Math.round(s / 60) + " min";
  }
  function bytes(b) {
    if (!b) return "0 B";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (b >= 1024 && i < units.length - 1) { b /= 1024; i += 1; }
    return b.toFixed(i ? 1 : 0) + " " + units[i];
  }
  function num(x, digits) {
    if (x === null || x === undefined) return "—";
    return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits === undefined ? 1 : digits });
  }
  function ms(x) { return x === null || x === undefined ? "—" : num(x, 0) + " ms"; }
  function gearText(g) { return g ? (g.name || g.shape) + " · " + g.gpu_count + " GPU" + (g.gpu_count === 1 ? "" : "s") : "—"; }

  function setPill(node, cls, text, state) {
    node.className = "pill " + cls;
    node.textContent = text;
    if (state !== undefined) node.dataset.state = state;
  }

  function deploymentUrl(name) { return "/deployments/" + encodeURIComponent(name) + "/"; }
  function transitionUrl(name, seq) { return deploymentUrl(name) + "transitions/" + seq + "/"; }
  function decisionUrl(id) { return "/decisions/" + id + "/"; }

  function link(href, text) { return el("a", { href: href }, text); }

  // --- the switch timeline: one row per transition, one bar per phase, on the wall clock -------------
  function gantt(div, transitions, opts) {
    opts = opts || {};
    const rows = transitions.slice().sort(function (a, b) { return a.created_at < b.created_at ? -1 : 1; });
    const now = Date.now();
    const byPhase = {};
    const labels = [];
    rows.forEach(function (t) {
      const label = (opts.withDeployment ? t.deployment + " " : "") + "#" + t.seq + " " + t.kind;
      labels.push(label);
      t.phases.forEach(function (p) {
        const start = Date.parse(p.started_at);
        const end = p.ended_at ? Date.parse(p.ended_at) : now;
        const trace = byPhase[p.phase] = byPhase[p.phase] || { x: [], base: [], y: [], customdata: [] };
        trace.x.push(Math.max(end - start, 40));  // a phase of a few ms still shows
        trace.base.push(new Date(start).toISOString());
        trace.y.push(label);
        trace.customdata.push([secs(p.duration_s), p.running ? "running" : "done", t.phase, t.to_gear ? t.to_gear.name || t.to_gear.shape : ""]);
      });
    });
    const order = ["prepare", "switch", "cleanup", "rollback"];
    const traces = order.filter(function (p) { return byPhase[p]; }).map(function (p) {
      const t = byPhase[p];
      return { type: "bar", orientation: "h", name: p, x: t.x, base: t.base, y: t.y, customdata: t.customdata,
               marker: { color: PHASE_COLORS[p] },
               hovertemplate: "<b>%{y}</b> · " + p + " %{customdata[0]} (%{customdata[1]})<br>now %{customdata[2]} → %{customdata[3]}<extra></extra>" };
    });
    div.dataset.rows = String(rows.length);
    div.dataset.labels = labels.join("|");
    if (!rows.length) {
      Plotly.purge(div);
      div.textContent = "";
      div.appendChild(el("p", { className: "muted" }, "No transition yet."));
      return;
    }
    const empty = div.querySelector("p.muted");
    if (empty) empty.remove();
    Plotly.react(div, traces, {
      barmode: "overlay", height: Math.max(170, 34 * rows.length + 100), margin: { l: 150, r: 20, t: 30, b: 50 },
      xaxis: { type: "date", title: { text: "wall clock (UTC)" } },
      yaxis: { type: "category", categoryorder: "array", categoryarray: labels, automargin: true },
      legend: { orientation: "h", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom" }, showlegend: true,
    }, { displaylogo: false, responsive: true });
  }

  // --- the gear diagram: every GPU of the nodes it touches; its GPUs coloured by stage ---------------
  function gearDiagram(div, gear, gpus, title) {
    if (!gear) {
      Plotly.purge(div);
      div.textContent = "";
      div.appendChild(el("p", { className: "muted" }, title + ": none (nothing runs yet)"));
      return;
    }
    const empty = div.querySelector("p.muted");
    if (empty) empty.remove();
    const nodes = Array.from(new Set(gpus.map(function (g) { return g.node; }))).sort();
    const used = {};
    const traces = [];
    let colour = 0;
    gear.plans.forEach(function (plan, pi) {
      plan.stages.forEach(function (s) {
        const name = (gear.plans.length > 1 ? "plan " + (pi + 1) + " " : "") +
                     (s.pipeline === "main" ? "" : s.pipeline + " ") + "stage " + s.index +
                     " · layers " + s.layers[0] + "–" + s.layers[1] + " · TP" + s.tp;
        const x = [], y = [], text = [], custom = [];
        s.gpus.forEach(function (g) {
          if (g.node === null) return;
          used[g.uuid] = true;
          x.push("GPU " + g.index); y.push(g.node); text.push(g.in_block === false ? "S" + s.index + "✕" : "S" + s.index);
          custom.push([g.uuid, g.model, plan.shape + " · weight " + Math.round(plan.weight * 100) + "%",
                       g.in_block === false ? "out: " + g.out_reason : "in a block"]);
        });
        traces.push({ type: "scatter", mode: "markers+text", name: name, x: x, y: y, text: text, customdata: custom,
                      textfont: { color: "#fff", size: 11 },
                      marker: { symbol: "square", size: 34, color: STAGE_COLORS[colour % STAGE_COLORS.length] },
                      hovertemplate: "<b>%{y} · %{x}</b><br>" + name + "<br>%{customdata[2]}<br>%{customdata[1]} · %{customdata[3]}<br>%{customdata[0]}<extra></extra>" });
        colour += 1;
      });
    });
    // the GPUs around the gear, by what they are: free, another tenant's (T), failed or unreachable (✕)
    const OTHER = { tenant: ["another tenant's", "T", "#8a94a6", "square"], unhealthy: ["failed", "✕", "#c0362c", "square-x-open"],
                    unreachable: ["unreachable", "?", "#c0362c", "square-open"] };
    const other = gpus.filter(function (g) { return !used[g.uuid]; });
    [["free or another deployment's", null]].concat(Object.keys(OTHER).map(function (k) { return [OTHER[k][0], k]; }))
      .forEach(function (kind) {
        const pick = other.filter(function (g) { return kind[1] ? g.state === kind[1] : !OTHER[g.state]; });
        if (!pick.length) return;
        const look = kind[1] ? OTHER[kind[1]] : [kind[0], "", "#c9ced6", "square-open"];
        traces.unshift({ type: "scatter", mode: "markers+text", name: look[0],
                         x: pick.map(function (g) { return "GPU " + g.index; }), y: pick.map(function (g) { return g.node; }),
                         text: pick.map(function () { return look[1]; }), textfont: { color: look[2], size: 13 },
                         customdata: pick.map(function (g) { return [g.uuid, g.model, g.in_block === false ? "out: " + g.out_reason : look[0]]; }),
                         marker: { symbol: look[3], size: 30, color: look[2], line: { width: 1.5, color: look[2] }, opacity: kind[1] ? 0.55 : 1 },
                         hovertemplate: "<b>%{y}/%{x}</b><br>%{customdata[1]} · %{customdata[2]}<br>%{customdata[0]}<extra></extra>" });
      });
    const width = Math.max(1, ...gpus.map(function (g) { return g.index + 1; }));
    div.dataset.gearId = gear.gear_id;
    Plotly.react(div, traces, {
      title: { text: title + ": " + (gear.name || gear.shape) + " <span style='font-size:11px;color:#667085'>" + gear.gear_id + "</span>", font: { size: 13 } },
      height: Math.max(170, 56 * nodes.length + 110), margin: { l: 10, r: 10, t: 36, b: 10 },
      xaxis: { type: "category", side: "top", categoryorder: "array",
               categoryarray: Array.from({ length: width }, function (_, i) { return "GPU " + i; }) },
      yaxis: { type: "category", categoryorder: "array", categoryarray: nodes.slice().reverse(), automargin: true },
      legend: { orientation: "h", y: -0.05, font: { size: 11 } }, showlegend: true,
    }, { displaylogo: false, responsive: true });
  }

  // --- tables ---------------------------------------------------------------------------------------
  function cell(tr, content, cls) {
    const td = el("td", { className: cls || null });
    if (content instanceof Node) td.appendChild(content); else td.textContent = content === null || content === undefined ? "—" : String(content);
    tr.appendChild(td);
    return td;
  }

  function healthPill(h) {
    const span = el("span", { className: "pill " + (HEALTH_PILL[h.state] || "pill-off"), title: h.reasons.join("\n") }, h.state);
    span.dataset.state = h.state;
    return span;
  }

  function phasePill(t) {
    const cls = t.active ? "pill-wait" : (t.phase === "done" ? "pill-ok" : "pill-bad");
    const span = el("span", { className: "pill " + cls }, t.phase + (t.active && t.step ? " · " + t.step : ""));
    span.dataset.phase = t.phase;
    return span;
  }

  function deploymentsTable(tbody, deployments) {
    tbody.innerHTML = "";
    deployments.forEach(function (d) {
      const tr = el("tr", { "data-deployment": d.name, "data-health": d.health.state, "data-mode": d.mode });
      cell(tr, link(deploymentUrl(d.name), d.name), "strong");
      cell(tr, d.model_name + (d.model_version ? " @" + d.model_version.version : ""));
      cell(tr, el("span", { className: "pill " + (MODE_PILL[d.mode] || "") }, d.mode));
      cell(tr, d.current_gear ? (d.current_gear.name || d.current_gear.shape) + (d.on_baseline ? " (baseline)" : "") : "—", "small");
      cell(tr, d.current_gear ? d.current_gear.gpu_count : 0);
      cell(tr, healthPill(d.health));
      cell(tr, d.serving ? num(d.serving.tokens_per_s, 0) : "—");
      cell(tr, d.serving ? ms(d.serving.ttft_p95_ms) : "—");
      const at = d.active_transition;
      cell(tr, at ? link(transitionUrl(d.name, at.seq), "#" + at.seq + " " + at.kind + " · " + at.phase) : "—");
      tbody.appendChild(tr);
    });
  }

  function transitionsTable(tbody, transitions, opts) {
    opts = opts || {};
    tbody.innerHTML = "";
    transitions.forEach(function (t) {
      const tr = el("tr", { "data-seq": t.seq, "data-kind": t.kind, "data-phase": t.phase, "data-deployment": t.deployment });
      cell(tr, link(transitionUrl(t.deployment, t.seq), (opts.withDeployment ? t.deployment + " " : "") + "#" + t.seq));
      cell(tr, t.kind);
      cell(tr, phasePill(t));
      cell(tr, (t.from_gear ? t.from_gear.name || t.from_gear.shape : "∅") + " → " + (t.to_gear.name || t.to_gear.shape), "small");
      cell(tr, timeEl(t.created_at));
      cell(tr, span(t.duration_s || 0) + (t.active ? " so far" : ""));
      cell(tr, bytes(t.moved.kv_bytes_migrated));
      cell(tr, num(t.moved.tokens_replayed, 0));
      if (opts.withActor) cell(tr, t.actor, "small");
      if (t.error) tr.title = t.error;
      tbody.appendChild(tr);
    });
  }

  window.FlexPipe = window.FlexPipe || {};
  window.FlexPipe.gb = {
    el: el, post: post, errorText: errorText, when: when, clock: clock, secs: secs, bytes: bytes, num: num, ms: ms,
    span: span, relative: relative, timeEl: timeEl,
    gearText: gearText, setPill: setPill, link: link, cell: cell, healthPill: healthPill, phasePill: phasePill,
    deploymentUrl: deploymentUrl, transitionUrl: transitionUrl, decisionUrl: decisionUrl,
    gantt: gantt, gearDiagram: gearDiagram, deploymentsTable: deploymentsTable, transitionsTable: transitionsTable,
    HEALTH_PILL: HEALTH_PILL, MODE_PILL: MODE_PILL, PHASE_COLORS: PHASE_COLORS,
  };
})();
