// The Deployment page: summary, gear diagram, serving charts, switch timeline (a Gantt of phases) and
// decisions, all kept current by /ws/deployments/<name>/. Operators also get the mode, pin and
// emergency controls (the API checks the role anyway); the emergency asks for a reason and a
// confirmation before it is sent.
(function () {
  "use strict";
  const gb = window.FlexPipe.gb;
  const data = JSON.parse(document.getElementById("deployment-data").textContent);
  const name = data.name;
  const canOperate = data.can_operate;
  const MAX_POINTS = 500;
  const state = { deployment: null, transitions: {}, decisions: {}, gears: {}, gpus: [], load: [], points: [] };
  window.FlexPipe.deployment = state;

  // --- summary ---------------------------------------------------------------------------------------
  function fact(dl, term, content) {
    dl.appendChild(gb.el("dt", {}, term));
    const dd = gb.el("dd");
    if (content instanceof Node) dd.appendChild(content); else dd.textContent = content;
    dl.appendChild(dd);
  }

  function renderSummary() {
    const d = state.deployment;
    gb.setPill(document.getElementById("mode"), gb.MODE_PILL[d.mode] || "", "mode: " + d.mode, d.mode);
    gb.setPill(document.getElementById("health"), gb.HEALTH_PILL[d.health.state] || "pill-off", d.health.state, d.health.state);
    const reasons = document.getElementById("health-reasons");
    reasons.innerHTML = "";
    d.health.reasons.forEach(function (r) { reasons.appendChild(gb.el("li", {}, r)); });
    const dl = document.getElementById("facts");
    dl.innerHTML = "";
    fact(dl, "Model", d.model_name + (d.model_version ? " @" + d.model_version.version + " (" + d.model_version.status + ", sha256 " + d.model_version.sha256.slice(0, 12) + "…)" : " (no registry version)"));
    fact(dl, "SLO", "TTFT " + gb.ms(d.slo.ttft_ms) + " · TPOT " + gb.ms(d.slo.tpot_ms) + " · priority " + d.priority);
    fact(dl, "Current gear", d.current_gear ? gb.gearText(d.current_gear) + " · " + d.current_gear.gear_id + (d.on_baseline ? " (the baseline)" : "") : "none yet");
    fact(dl, "Baseline gear", gb.gearText(d.baseline_gear) + " · " + d.baseline_gear.gear_id);
    fact(dl, "Pinned gear", d.pinned_gear ? gb.gearText(d.pinned_gear) + " · " + d.pinned_gear.gear_id : "—");
    const at = d.active_transition;
    fact(dl, "Transition", at ? gb.link(gb.transitionUrl(name, at.seq), "#" + at.seq + " " + at.kind + " · " + at.phase + (at.step ? " · " + at.step : "")) : "none running");
    if (d.emergency) fact(dl, "Emergency", "requested " + gb.when(d.emergency.requested_at) + " by " + d.emergency.actor + ": " + d.emergency.reason);
    if (d.pending_decision) fact(dl, "Waiting for approval", gb.link(gb.decisionUrl(d.pending_decision), "decision " + d.pending_decision));
    fact(dl, "Routing", "version " + d.routing.version);
    const tbody = document.querySelector("#routes tbody");
    tbody.innerHTML = "";
    d.routing.routes.forEach(function (r) {
      const tr = gb.el("tr", { "data-plan": r.plan_id });
      gb.cell(tr, r.plan_id, "mono");
      gb.cell(tr, r.shape || "—");
      gb.cell(tr, Math.round(r.weight * 100) + "%");
      gb.cell(tr, r.frozen ? "frozen" : "—");
      gb.cell(tr, r.nodes.join(", "));
      tbody.appendChild(tr);
    });
    renderControls();
  }

  // --- controls (operators) --------------------------------------------------------------------------
  function renderControls() {
    if (!canOperate) return;
    const d = state.deployment;
    document.querySelectorAll("#controls [data-mode]").forEach(function (b) {
      b.classList.toggle("selected", b.dataset.mode === d.mode);
      b.setAttribute("aria-pressed", b.dataset.mode === d.mode ? "true" : "false");
    });
    document.getElementById("pin-button").disabled = !d.current_gear || d.mode === "pinned";
    document.getElementById("unpin-button").disabled = d.mode !== "pinned";
    document.getElementById("emergency-baseline").textContent = gb.gearText(d.baseline_gear);
  }

  function say(text, ok) {
    const out = document.getElementById("control-result");
    out.textContent = text;
    out.className = "small " + (ok ? "ok" : "error");
  }

  function act(path, body, done) {
    return gb.post("/api/v1/deployments/" + encodeURIComponent(name) + "/" + path, body).then(function (r) {
      if (r.status >= 200 && r.status < 300) {
        const dep = r.body.deployment || r.body;
        if (dep && dep.name === name) { state.deployment = dep; renderSummary(); }
        say(done(r), true);
      } else {
        say(gb.errorText(r.body), false);
      }
      return r;
    });
  }

  function wireControls() {
    if (!canOperate) return;
    document.querySelectorAll("#controls [data-mode]").forEach(function (b) {
      b.addEventListener("click", function () {
        act("mode", { mode: b.dataset.mode }, function () { return "mode set to " + b.dataset.mode; });
      });
    });
    document.getElementById("pin-button").addEventListener("click", function () {
      const current = state.deployment.current_gear;
      act("pin", { gear_id: current ? current.gear_id : "current" }, function (r) {
        return "pinned " + r.body.pinned_gear.shape + " (" + r.body.pinned_gear.gear_id + ")";
      });
    });
    document.getElementById("unpin-button").addEventListener("click", function () {
      act("unpin", { mode: "auto" }, function () { return "unpinned: automatic again"; });
    });
    const dialog = document.getElementById("emergency-dialog");
    const form = document.getElementById("emergency-form");
    const confirmButton = document.getElementById("emergency-confirm");
    const error = document.getElementById("emergency-error");
    function ready() { confirmButton.disabled = !(form.reason.value.trim() && form.confirm.checked); }
    form.reason.addEventListener("input", ready);
    form.confirm.addEventListener("change", ready);
    document.getElementById("emergency-button").addEventListener("click", function () {
      form.reset(); error.textContent = ""; ready();
      dialog.showModal();
      form.reason.focus();
    });
    document.getElementById("emergency-cancel").addEventListener("click", function () { dialog.close(); });
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      if (confirmButton.disabled) return;
      confirmButton.disabled = true;
      act("emergency", { reason: form.reason.value }, function (r) {
        const words = { requested: "emergency downshift requested", already_requested: "already requested: nothing new",
                        already_running: "the downshift is already running", already_on_baseline: "already on the baseline: nothing to do" };
        return words[r.body.state] || r.body.state;
      }).then(function (r) {
        if (r.status >= 200 && r.status < 300) dialog.close();
        else { error.textContent = gb.errorText(r.body); ready(); }
      });
    });
  }

  // --- gears -----------------------------------------------------------------------------------------
  function renderGears() {
    gb.gearDiagram(document.getElementById("gear-current"), state.gears.current, state.gpus, "current");
    const target = state.gears.target;
    const div = document.getElementById("gear-target");
    const show = target && (!state.gears.current || target.gear_id !== state.gears.current.gear_id);
    div.hidden = !show;
    if (show) gb.gearDiagram(div, target, state.gpus, "target (#" + state.deployment.active_transition.seq + ")");
  }

  // --- serving charts --------------------------------------------------------------------------------
  function addPoint(serving) {
    if (!serving || !serving.reported_at) return;
    const last = state.points[state.points.length - 1];
    if (last && last.at === serving.reported_at) return;
    state.points.push({ at: serving.reported_at, tokens_per_s: serving.tokens_per_s, ttft_p50_ms: serving.ttft_p50_ms,
                        ttft_p95_ms: serving.ttft_p95_ms, tpot_p95_ms: serving.tpot_p95_ms, running: serving.running });
    if (state.points.length > MAX_POINTS) state.points.shift();
  }

  function line(name, x, y, extra) { return Object.assign({ type: "scatter", mode: "lines+markers", name: name, x: x, y: y }, extra || {}); }
  function sloLine(x, value) {
    return line("SLO", x.length ? [x[0], x[x.length - 1]] : [], x.length ? [value, value] : [],
                { mode: "lines", line: { dash: "dash", color: "#c0362c", width: 1 } });
  }
  const CHART = { margin: { l: 50, r: 10, t: 30, b: 30 }, height: 220, xaxis: { type: "date" }, legend: { orientation: "h", y: -0.25 } };
  // A chart with no sample yet says so, instead of plotly's default axes (a year 2000 date range).
  function chartLayout(title, n, what, extra) {
    const layout = Object.assign({}, CHART, { title: { text: title, font: { size: 13 } } }, extra || {});
    if (n) return layout;
    return Object.assign(layout, {
      xaxis: { type: "date", visible: false }, yaxis: { visible: false }, showlegend: false,
      annotations: [{ text: what, showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5, font: { color: "#6b7280" } }],
    });
  }

  function renderCharts() {
    const p = state.points;
    const x = p.map(function (q) { return q.at; });
    const slo = state.deployment.slo;
    const cfg = { displaylogo: false, responsive: true };
    const noReport = "no engine report yet";
    Plotly.react("chart-throughput", [line("tokens/s", x, p.map(function (q) { return q.tokens_per_s; }))],
                 chartLayout("Throughput (output tokens/s)", p.length, noReport, { showlegend: false }), cfg);
    Plotly.react("chart-p95", [line("TPOT P95", x, p.map(function (q) { return q.tpot_p95_ms; })), sloLine(x, slo.tpot_ms)],
                 chartLayout("P95 time per output token (ms)", p.length, noReport), cfg);
    Plotly.react("chart-ttft", [line("P50", x, p.map(function (q) { return q.ttft_p50_ms; })),
                                line("P95", x, p.map(function (q) { return q.ttft_p95_ms; })), sloLine(x, slo.ttft_ms)],
                 chartLayout("Time to first token (ms)", p.length, noReport), cfg);
    const lx = state.load.map(function (s) { return s.at; });
    // one sample alone would get an axis a millisecond wide: show a minute either side of it
    const xaxis = lx.length === 1 ? { type: "date", range: [Date.parse(lx[0]) - 60000, Date.parse(lx[0]) + 60000] } : { type: "date" };
    Plotly.react("chart-load", [line("req/s", lx, state.load.map(function (s) { return s.rate_rps; }))],
                 chartLayout("Offered load (requests/s, the gearbox's window)", lx.length, "no load sample in the window yet",
                             { xaxis: xaxis, showlegend: false }), cfg);
    document.getElementById("chart-throughput").dataset.points = String(p.length);
  }

  // --- timeline and decisions ------------------------------------------------------------------------
  function renderTimeline() {
    const rows = Object.values(state.transitions).sort(function (a, b) { return b.seq - a.seq; }).slice(0, 25);
    gb.gantt(document.getElementById("timeline"), rows);
    gb.transitionsTable(document.querySelector("#transitions tbody"), rows, { withActor: true });
  }

  function renderDecisions() {
    const tbody = document.querySelector("#decisions tbody");
    tbody.innerHTML = "";
    Object.values(state.decisions).sort(function (a, b) { return b.id - a.id; }).slice(0, 25).forEach(function (d) {
      const tr = gb.el("tr", { "data-decision": d.id, "data-outcome": d.outcome });
      gb.cell(tr, gb.link(gb.decisionUrl(d.id), String(d.id)));
      gb.cell(tr, gb.when(d.at));
      gb.cell(tr, d.trigger);
      gb.cell(tr, gb.el("span", { className: "pill " + (d.outcome === "switch" ? "pill-ok" : d.outcome === "advise" ? "pill-wait" : d.outcome === "blocked" ? "pill-bad" : "pill-off") }, d.outcome));
      gb.cell(tr, d.target_shape || "—");
      gb.cell(tr, d.best ? gb.num(d.best.gain_tokens, 0) : "—");
      gb.cell(tr, d.best ? gb.num(d.best.threshold_tokens, 0) : "—");
      gb.cell(tr, d.reasons.join("; "), "small");
      const last = gb.cell(tr, d.approval === "pending" ? "" : (d.approval || ""), "small");
      if (d.approval === "pending" && canOperate) {
        const b = gb.el("button", { type: "button", className: "small" }, "Approve");
        b.dataset.approve = String(d.id);
        b.addEventListener("click", function () {
          b.disabled = true;
          gb.post("/api/v1/decisions/" + d.id + "/approve", {}).then(function (r) {
            if (r.status === 201) say("approved: transition #" + r.body.seq + " started", true);
            else { say(gb.errorText(r.body), false); b.disabled = false; }
          });
        });
        last.appendChild(b);
      } else if (d.approval === "pending") {
        last.textContent = "waiting for approval";
      }
      tbody.appendChild(tr);
    });
  }

  // --- routing decisions (a sample the gateways keep) -------------------------------------------------
  function short(id) { return id.length > 14 ? id.slice(0, 12) + "…" : id; }

  function planText(p) {
    if (p.filtered) return short(p.plan_id) + " (" + p.gpu + "): " + p.filtered;
    const s = p.scores || {};
    const parts = [short(p.plan_id) + " (" + p.gpu + ")"];
    if (p.total !== undefined) {
      parts.push(gb.num(p.total, 0) + " = " + gb.num(s.predicted_latency, 0) + " · " + gb.num(s.prefix_affinity, 0)
                 + " · " + gb.num(s.topology_affinity, 0));
    }
    if (p.predicted_ttft_ms !== undefined) parts.push("TTFT ~" + gb.ms(p.predicted_ttft_ms));
    if (p.demoted) parts.push("demoted (jitter)");
    return parts.join(" ");
  }

  function renderRouteSamples(samples) {
    const tbody = document.querySelector("#route-samples tbody");
    if (!samples || !samples.length) return;
    tbody.innerHTML = "";
    samples.forEach(function (d) {
      const tr = gb.el("tr", { "data-chosen": d.taken_by || d.chosen || "" });
      const r = d.request;
      gb.cell(tr, gb.when(d.at));
      gb.cell(tr, r.prompt_tokens + " + " + r.max_tokens + " tokens" + (r.priority ? " · priority " + r.priority : "")
                  + (r.deadline_ms ? " · deadline " + gb.ms(r.deadline_ms) : ""), "small");
      gb.cell(tr, short(d.taken_by || d.chosen || "—") + (d.note ? " (" + d.note + ")" : ""), "mono");
      const ul = gb.el("ul", { className: "reasons small" });
      d.plans.slice().sort(function (a, b) { return (a.rank || 99) - (b.rank || 99); }).forEach(function (p) {
        ul.appendChild(gb.el("li", {}, planText(p)));
      });
      gb.cell(tr, ul);
      tbody.appendChild(tr);
    });
  }

  // --- state -----------------------------------------------------------------------------------------
  function apply(msg) {
    if (msg.type === "snapshot") {
      state.transitions = {};
      state.decisions = {};
      msg.transitions.forEach(function (t) { state.transitions[t.seq] = t; });
      msg.decisions.forEach(function (d) { state.decisions[d.id] = d; });
      renderTimeline();
      renderDecisions();
    }
    if (msg.type === "snapshot" || msg.type === "deployment") {
      state.deployment = msg.deployment;
      state.gears = msg.gears;
      state.gpus = msg.gpus;
      state.load = msg.load;
      addPoint(msg.deployment.serving);
      renderSummary();
      renderGears();
      renderCharts();
      renderRouteSamples(msg.route_samples);
    } else if (msg.type === "transition") {
      state.transitions[msg.transition.seq] = msg.transition;
      renderTimeline();
    } else if (msg.type === "decision") {
      state.decisions[msg.decision.id] = msg.decision;
      renderDecisions();
    }
  }

  apply(Object.assign({ type: "snapshot" }, data));
  wireControls();
  setInterval(function () {
    if (Object.values(state.transitions).some(function (t) { return t.active; })) renderTimeline();
  }, 1000);
  window.FlexPipe.live.connect("/ws/deployments/" + encodeURIComponent(name) + "/", apply,
                               document.getElementById("live-status"));
})();
