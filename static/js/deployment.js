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

  // token-weighted utilisation (scheduler/pool/twu.py): the deployment's, then each plan's that reported
  function twuText(t) {
    if (!t) return "— (nothing runs)";
    const plans = t.plans.filter(function (p) { return p.twu != null; }).map(function (p) {
      return p.plan_id.slice(0, 8) + " " + p.twu.toFixed(2) + (p.prefill !== p.decode ? " (prefill " + p.prefill.toFixed(2) + ", decode " + p.decode.toFixed(2) + ")" : "");
    });
    return (t.value == null ? "— (no engine report yet)" : t.value.toFixed(2) + " of the modelled capacity") + (plans.length > 1 ? " · " + plans.join(" · ") : "");
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
    fact(dl, d.mode === "emergency" ? "Held gear" : "Pinned gear", d.pinned_gear ? gb.gearText(d.pinned_gear) + " · " + d.pinned_gear.gear_id : "—");
    const at = d.active_transition;
    fact(dl, "Transition", at ? gb.link(gb.transitionUrl(name, at.seq), "#" + at.seq + " " + at.kind + " · " + at.phase + (at.step ? " · " + at.step : "")) : "none running");
    renderEmergency(d.emergency);
    if (d.pending_decision) fact(dl, "Waiting for approval", gb.link(gb.decisionUrl(d.pending_decision), "decision " + d.pending_decision));
    fact(dl, "Routing", "version " + d.routing.version);
    fact(dl, "TWU", twuText(d.twu));
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

  // --- the emergency: held, pending, blocked (in red) ------------------------------------------------
  const EMERGENCY_TITLES = { pending: "Emergency downshift requested", blocked: "Emergency downshift BLOCKED",
                             running: "Emergency downshift running", holding: "Emergency: holding",
                             failed: "Emergency downshift FAILED" };

  // The planner's best safe gears, offered when the baseline cannot run - never to be mistaken for it.
  function offerCards(div, offers, reason) {
    div.innerHTML = "";
    (offers || []).slice(0, 3).forEach(function (o, i) {
      const card = gb.el("div", { className: "offer", "data-offer": o.gear_id });
      card.appendChild(gb.el("div", { className: "label" }, (i === 0 ? "Offered instead: " : "Also safe: ") + o.label));
      card.appendChild(gb.el("div", { className: "strong" }, o.name + " · " + o.gpu_count + " GPU" + (o.gpu_count === 1 ? "" : "s")));
      const e = o.estimate || {};
      card.appendChild(gb.el("div", { className: "small" }, (o.meets_slo ? "meets the SLOs" : "misses the SLOs") +
        " · goodput " + gb.num(e.goodput_tokens_s, 0) + " tokens/s · TTFT P99 " + gb.secs(e.ttft_p99_s) +
        " · TPOT P99 " + gb.secs(e.tpot_p99_s) + " (the planner's estimate)"));
      if (canOperate) {
        const b = gb.el("button", { type: "button", className: "danger small" }, "Downshift to this gear instead");
        b.dataset.acceptOffer = o.gear_id;
        b.addEventListener("click", function () {
          b.disabled = true;
          sendEmergency(reason(), o.gear_id).then(function (r) { if (r.status >= 300) b.disabled = false; });
        });
        card.appendChild(b);
      }
      div.appendChild(card);
    });
  }

  function renderEmergency(e) {
    const banner = document.getElementById("emergency-banner");
    banner.hidden = !e;
    if (!e) { delete banner.dataset.state; return; }
    banner.dataset.state = e.state;
    banner.className = "banner " + (e.state === "holding" || e.state === "running" || e.state === "pending" ? "banner-hold" : "banner-bad");
    document.getElementById("emergency-title").textContent = EMERGENCY_TITLES[e.state] + ":";
    const target = e.target ? e.target.name + (e.on_baseline ? " (the baseline)" : " (not the baseline: the gear an operator accepted)") : "";
    const detail = document.getElementById("emergency-detail");
    detail.textContent = target + " — by " + e.actor + ": " + e.reason + (e.error ? " — " + e.error : "") +
      (e.state === "holding" ? " — never switched automatically until released." : "");
    const ul = document.getElementById("emergency-blocked");
    ul.innerHTML = "";
    (e.blocked || []).forEach(function (r) { ul.appendChild(gb.el("li", {}, r)); });
    offerCards(document.getElementById("emergency-offers"), e.offers, function () { return e.reason; });
  }

  // --- controls (operators) --------------------------------------------------------------------------
  function renderControls() {
    if (!canOperate) return;
    const d = state.deployment;
    const held = d.mode === "emergency";
    document.querySelectorAll("#controls [data-mode]").forEach(function (b) {
      b.classList.toggle("selected", b.dataset.mode === d.mode);
      b.setAttribute("aria-pressed", b.dataset.mode === d.mode ? "true" : "false");
      b.disabled = held;  // an emergency holds until it is released (the banner's buttons)
    });
    document.getElementById("pin-button").disabled = held || !d.current_gear || d.mode === "pinned";
    document.getElementById("unpin-button").disabled = d.mode !== "pinned";
    document.getElementById("emergency-baseline").textContent = gb.gearText(d.baseline_gear);
  }

  function say(text, ok) {
    const out = document.getElementById("control-result");
    out.textContent = text;
    out.className = "small " + (ok ? "ok" : "error");
  }

  function act(path, body, done, refused) {
    return gb.post("/api/v1/deployments/" + encodeURIComponent(name) + "/" + path, body).then(function (r) {
      if (r.status >= 200 && r.status < 300) {
        const dep = r.body.deployment || r.body;
        if (dep && dep.name === name) { state.deployment = dep; renderSummary(); }
        say(done(r), true);
      } else {
        say(refused ? refused(r) : gb.errorText(r.body), false);
      }
      return r;
    });
  }

  // The emergency verb: accepted (202/200) closes the dialog; blocked (409) stays open, in red, with
  // the reason, what to do and the offered safe gear - the page never says "requested" for it.
  function sendEmergency(reason, gearId) {
    const body = { reason: reason };
    if (gearId) body.gear_id = gearId;
    const dialog = document.getElementById("emergency-dialog");
    const error = document.getElementById("emergency-error");
    return act("emergency", body, function (r) {
      const words = { requested: "emergency downshift requested: it holds until released",
                      already_requested: "already requested: nothing new",
                      already_running: "the downshift is already running", holding: "on the target: held until released" };
      return words[r.body.state] || r.body.state;
    }, function (r) {
      return r.status === 409 && r.body.emergency ? "emergency downshift BLOCKED: " + r.body.emergency.join(" ") : gb.errorText(r.body);
    }).then(function (r) {
      if (r.status >= 200 && r.status < 300) { if (dialog.open) dialog.close(); return r; }
      error.innerHTML = "";
      if (r.status === 409 && r.body.emergency) {
        error.dataset.state = "blocked";
        error.appendChild(gb.el("b", {}, "Blocked — nothing was changed."));
        const ul = gb.el("ul", { className: "reasons" });
        r.body.emergency.forEach(function (t) { ul.appendChild(gb.el("li", {}, t)); });
        error.appendChild(ul);
        offerCards(document.getElementById("emergency-dialog-offers"), r.body.offers, function () { return reason; });
        if (!dialog.open) dialog.showModal();
      } else {
        error.textContent = gb.errorText(r.body);
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
    document.querySelectorAll("#emergency-banner [data-release]").forEach(function (b) {
      b.addEventListener("click", function () {
        act("release", { mode: b.dataset.release }, function (r) { return "emergency released: mode " + r.body.mode; });
      });
    });
    const dialog = document.getElementById("emergency-dialog");
    const form = document.getElementById("emergency-form");
    const confirmButton = document.getElementById("emergency-confirm");
    const error = document.getElementById("emergency-error");
    function ready() { confirmButton.disabled = !(form.reason.value.trim() && form.confirm.checked); }
    form.reason.addEventListener("input", ready);
    form.confirm.addEventListener("change", ready);
    document.getElementById("emergency-button").addEventListener("click", function () {
      form.reset(); error.textContent = ""; delete error.dataset.state; ready();
      document.getElementById("emergency-dialog-offers").innerHTML = "";
      dialog.showModal();
      form.reason.focus();
    });
    document.getElementById("emergency-cancel").addEventListener("click", function () { dialog.close(); });
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      if (confirmButton.disabled) return;
      confirmButton.disabled = true;
      sendEmergency(form.reason.value).then(function () { ready(); });
    });
  }

  // --- choosing a gear: the planner's candidates, an override, the baseline ---------------------------
  function renderCandidates(body) {
    const table = document.getElementById("candidates");
    const tbody = table.querySelector("tbody");
    tbody.innerHTML = "";
    table.hidden = false;
    table.dataset.rows = String(body.candidates.length);
    document.getElementById("candidates-note").textContent = body.candidates.length + " candidate(s), best first" +
      (body.workload ? ", at " + gb.num(body.workload.rate_rps, 2) + " req/s offered" : ", no load sample yet (placed for zero load)");
    body.candidates.forEach(function (c) {
      const tr = gb.el("tr", { "data-gear": c.gear_id });
      gb.cell(tr, c.name, "strong").title = c.gear_id + (c.note ? " · " + c.note : "");
      gb.cell(tr, c.gpu_count);
      gb.cell(tr, c.meets_slo ? "meets" : "misses", c.meets_slo ? "ok" : "error");
      gb.cell(tr, gb.num(c.estimate.goodput_tokens_s, 0) + " tok/s");
      gb.cell(tr, gb.num(c.estimate.capacity_rps, 1) + " req/s");
      gb.cell(tr, gb.secs(c.estimate.ttft_p99_s));
      gb.cell(tr, gb.secs(c.estimate.tpot_p99_s));
      const last = gb.cell(tr, "");
      if (canOperate) {
        const o = gb.el("button", { type: "button", className: "small" }, "Override to this gear");
        o.dataset.override = c.gear_id;
        o.addEventListener("click", function () { override({ gear_id: c.gear_id }); });
        const b = gb.el("button", { type: "button", className: "small ghost" }, "Make baseline");
        b.dataset.baseline = c.gear_id;
        b.addEventListener("click", function () { setBaseline({ gear_id: c.gear_id }); });
        last.appendChild(o); last.appendChild(b);
      }
      tbody.appendChild(tr);
    });
  }

  function listCandidates() {
    document.getElementById("candidates-note").textContent = "asking the planner…";
    return fetch("/api/v1/deployments/" + encodeURIComponent(name) + "/candidates", { credentials: "same-origin",
      headers: { Accept: "application/json" } }).then(function (r) { return r.json(); }).then(renderCandidates);
  }

  function override(body) {
    return act("override", body, function (r) {
      return "override: transition #" + r.body.seq + " to " + r.body.to_gear.name + " started; it holds (pinned)";
    });
  }

  function setBaseline(body) {
    return act("baseline", body, function (r) { return "the baseline is now " + r.body.baseline_gear.name; });
  }

  function specBody() {
    try { return { spec: JSON.parse(document.getElementById("spec-text").value) }; }
    catch (e) { say("spec: not JSON (" + e.message + ")", false); return null; }
  }

  function wireOverride() {
    document.getElementById("candidates-button").addEventListener("click", listCandidates);
    if (!canOperate) return;
    document.getElementById("spec-override").addEventListener("click", function () { const b = specBody(); if (b) override(b); });
    document.getElementById("spec-baseline").addEventListener("click", function () { const b = specBody(); if (b) setBaseline(b); });
    document.getElementById("baseline-current").addEventListener("click", function () { setBaseline({ gear_id: "current" }); });
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
  // The charts start from the stored last hour (serving_history), then each report that arrives live.
  function addPoint(serving) {
    if (!serving || !serving.reported_at) return;
    const last = state.points[state.points.length - 1];
    if (last && Date.parse(last.at) >= Date.parse(serving.reported_at)) return;
    state.points.push({ at: serving.reported_at, tokens_per_s: serving.tokens_per_s, ttft_p50_ms: serving.ttft_p50_ms,
                        ttft_p95_ms: serving.ttft_p95_ms, tpot_p95_ms: serving.tpot_p95_ms, running: serving.running });
    if (state.points.length > MAX_POINTS) state.points.shift();
  }
  (data.serving_history || []).forEach(function (p) { state.points.push(p); });

  function line(name, x, y, extra) { return Object.assign({ type: "scatter", mode: "lines+markers", name: name, x: x, y: y }, extra || {}); }
  function sloLine(x, value) {
    return line("SLO", x.length ? [x[0], x[x.length - 1]] : [], x.length ? [value, value] : [],
                { mode: "lines", line: { dash: "dash", color: "#c0362c", width: 1 } });
  }
  const CHART = { margin: { l: 60, r: 10, t: 30, b: 44 }, height: 230, legend: { orientation: "h", y: -0.32 } };
  // Wall-clock x axis in UTC; one point alone gets a minute either side (not a millisecond-wide axis).
  function timeAxis(x) {
    const axis = { type: "date", title: { text: "wall clock (UTC)", font: { size: 11 } } };
    if (x.length === 1) axis.range = [Date.parse(x[0]) - 60000, Date.parse(x[0]) + 60000];
    return axis;
  }
  // A chart with no sample yet says so, instead of plotly's default axes (a year 2000 date range).
  function chartLayout(title, n, what, extra, x, unit) {
    const layout = Object.assign({}, CHART, { title: { text: title, font: { size: 13 } }, xaxis: timeAxis(x || []),
                                              yaxis: { title: { text: unit || "", font: { size: 11 } }, rangemode: "tozero" } },
                                 extra || {});
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
                 chartLayout("Throughput", p.length, noReport, { showlegend: false }, x, "output tokens/s"), cfg);
    Plotly.react("chart-p95", [line("TPOT P95", x, p.map(function (q) { return q.tpot_p95_ms; })), sloLine(x, slo.tpot_ms)],
                 chartLayout("Time per output token, P95", p.length, noReport, {}, x, "ms"), cfg);
    Plotly.react("chart-ttft", [line("P50", x, p.map(function (q) { return q.ttft_p50_ms; })),
                                line("P95", x, p.map(function (q) { return q.ttft_p95_ms; })), sloLine(x, slo.ttft_ms)],
                 chartLayout("Time to first token", p.length, noReport, {}, x, "ms"), cfg);
    const lx = state.load.map(function (s) { return s.at; });
    Plotly.react("chart-load", [line("req/s", lx, state.load.map(function (s) { return s.rate_rps; }))],
                 chartLayout("Offered load (the gearbox's window)", lx.length, "no load sample in the window yet",
                             { showlegend: false }, lx, "requests/s"), cfg);
    document.getElementById("chart-throughput").dataset.points = String(p.length);
  }

  // --- timeline and decisions ------------------------------------------------------------------------
  function renderTimeline() {
    const rows = Object.values(state.transitions).sort(function (a, b) { return b.seq - a.seq; }).slice(0, 25);
    gb.gantt(document.getElementById("timeline"), rows);
    gb.transitionsTable(document.querySelector("#transitions tbody"), rows, { withActor: true });
  }

  // Newest first; a run of consecutive "stay" decisions with the same reasons (one per tick) folds into
  // one row that says how many and over what span; the outcome filter shows one kind only. The console
  // already counts a repeated "stay" on one row (d.repeats, d.last_at: issue 19): a folded group adds them up.
  const expanded = {};
  function decisionRow(tbody, d, extra) {
    const tr = gb.el("tr", { "data-decision": d.id, "data-outcome": d.outcome });
    if (extra) Object.keys(extra).forEach(function (k) { tr.setAttribute(k, extra[k]); });
    gb.cell(tr, gb.link(gb.decisionUrl(d.id), String(d.id)));
    gb.cell(tr, gb.timeEl(d.at));
    gb.cell(tr, d.trigger);
    const outcome = gb.cell(tr, gb.el("span", { className: "pill " + (d.outcome === "switch" ? "pill-ok" : d.outcome === "advise" ? "pill-wait" : d.outcome === "blocked" ? "pill-bad" : "pill-off") }, d.outcome));
    if ((d.repeats || 1) > 1) {
      tr.setAttribute("data-repeats", String(d.repeats));
      outcome.appendChild(gb.el("span", { className: "muted small repeats", title: "last at " + d.last_at },
                                " ×" + d.repeats + ", last " + gb.relative(d.last_at)));
    }
    gb.cell(tr, d.target_name || d.target_shape || "—", "small");
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
    return tr;
  }

  function renderDecisions() {
    const tbody = document.querySelector("#decisions tbody");
    tbody.innerHTML = "";
    const only = document.getElementById("decision-filter").value;
    const rows = Object.values(state.decisions).sort(function (a, b) { return b.id - a.id; })
      .filter(function (d) { return !only || d.outcome === only; });
    const groups = [];
    rows.forEach(function (d) {
      const g = groups[groups.length - 1];
      const key = d.outcome + "|" + d.trigger + "|" + d.reasons.join("|");
      if (g && d.outcome === "stay" && g.key === key) g.rows.push(d); else groups.push({ key: key, rows: [d] });
    });
    groups.slice(0, 40).forEach(function (g) {
      const head = g.rows[0];
      if (g.rows.length === 1 || expanded[head.id]) { g.rows.forEach(function (d) { decisionRow(tbody, d); }); return; }
      const oldest = g.rows[g.rows.length - 1];
      const ticks = g.rows.reduce(function (n, d) { return n + (d.repeats || 1); }, 0);
      const tr = decisionRow(tbody, head, { "data-folded": String(g.rows.length), "data-ticks": String(ticks) });
      const cell = tr.children[0];
      cell.appendChild(gb.el("span", { className: "muted small" }, " … " + oldest.id));
      const more = gb.el("button", { type: "button", className: "small ghost unfold" },
                         ticks + " × stay since " + gb.relative(oldest.at));
      more.addEventListener("click", function () { expanded[head.id] = true; renderDecisions(); });
      tr.children[3].appendChild(more);
    });
    document.getElementById("decisions").dataset.rows = String(rows.length);
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

  function rate(v) { return v === null || v === undefined ? "—" : (100 * v).toFixed(1) + "%"; }

  function renderRollout(changes) {
    const tbody = document.querySelector("#router-rollout tbody");
    if (!changes || !changes.length) return;
    tbody.innerHTML = "";
    changes.forEach(function (c) {
      const tr = gb.el("tr", { "data-stage": c.after });
      gb.cell(tr, gb.when(c.at));
      gb.cell(tr, c.before + " → " + c.after);
      gb.cell(tr, (100 * c.share).toFixed(0) + "%");
      gb.cell(tr, rate(c.learned_violation_rate) + " / " + rate(c.rr_violation_rate));
      gb.cell(tr, c.reason, "small");
      gb.cell(tr, c.process, "mono small");
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
      renderRollout(msg.router_rollout);
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
  wireOverride();
  document.getElementById("decision-filter").addEventListener("change", renderDecisions);
  setInterval(function () {
    if (Object.values(state.transitions).some(function (t) { return t.active; })) renderTimeline();
  }, 1000);
  window.FlexPipe.live.connect("/ws/deployments/" + encodeURIComponent(name) + "/", apply,
                               document.getElementById("live-status"));
})();
