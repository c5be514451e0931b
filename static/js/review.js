// Decision review: one decision or one transition replayed. The decision: its trigger, outcome, the
// hysteresis factor and reasons, and every candidate side by side (gain against cost x factor). The
// transition(s): phases on the clock, each step with its timing, what moved (KV migrated against
// tokens replayed) and the gears before and after. /ws/deployments/<name>/ keeps a running one live.
(function () {
  "use strict";
  const gb = window.FlexPipe.gb;
  const data = JSON.parse(document.getElementById("review-data").textContent);
  const state = { decision: data.decision, transitions: {} };
  data.transitions.forEach(function (t) { state.transitions[t.seq] = t; });
  window.FlexPipe.review = state;

  function fact(dl, term, content) {
    dl.appendChild(gb.el("dt", {}, term));
    const dd = gb.el("dd");
    if (content instanceof Node) dd.appendChild(content); else dd.textContent = content;
    dl.appendChild(dd);
  }

  // --- the decision ----------------------------------------------------------------------------------
  function renderDecision() {
    const d = state.decision;
    const section = document.getElementById("decision");
    if (!d) { section.hidden = true; return; }
    section.hidden = false;
    section.dataset.decision = String(d.id);
    document.getElementById("decision-title").replaceChildren(
      data.focus === "decision" ? document.createTextNode("Decision " + d.id) : gb.link(gb.decisionUrl(d.id), "Decision " + d.id));
    gb.setPill(document.getElementById("decision-outcome"), d.outcome === "switch" ? "pill-ok" : d.outcome === "advise" ? "pill-wait" : d.outcome === "blocked" ? "pill-bad" : "pill-off", d.outcome, d.outcome);
    const approval = document.getElementById("decision-approval");
    approval.hidden = !d.approval;
    if (d.approval) gb.setPill(approval, d.approval === "pending" ? "pill-wait" : "pill-off", "approval: " + d.approval + (d.approved_by ? " by " + d.approved_by : ""), d.approval);
    const button = document.getElementById("approve-button");
    button.hidden = !(data.can_operate && d.approval === "pending");
    const dl = document.getElementById("decision-facts");
    dl.innerHTML = "";
    fact(dl, "Deployment", gb.link(gb.deploymentUrl(d.deployment), d.deployment));
    fact(dl, "At", gb.when(d.at));
    fact(dl, "Trigger", d.trigger);
    fact(dl, "Hysteresis factor", "× " + d.factor);
    fact(dl, "By", d.actor);
    fact(dl, "From gear", (d.current && d.current.gear_id) ? d.current.gear_id + (d.current.valid === false ? " (no longer valid)" : "") +
         (d.current.value_tokens_s !== null && d.current.value_tokens_s !== undefined ? " · value " + gb.num(d.current.value_tokens_s, 0) + " tokens/s" : "") : "none");
    fact(dl, "Target gear", d.target_gear ? (d.target_name || d.target_gear.shape) + " · " + d.target_gear.gear_id : "none");
    if (d.workload) fact(dl, "Offered load", gb.num(d.workload.rate_rps, 2) + " req/s · prompt " + gb.num(d.workload.prompt_tokens_mean, 0) + " · output " + gb.num(d.workload.output_tokens_mean, 0) + " tokens");
    if (d.cooldown_until) fact(dl, "Cooldown until", gb.timeEl(d.cooldown_until));
    if (d.note) fact(dl, "Note", d.note);
    fact(dl, "Transitions", d.transitions.length ? d.transitions.map(function (s) { return "#" + s; }).join(", ") : "none");
    const reasons = document.getElementById("decision-reasons");
    reasons.innerHTML = "";
    d.reasons.forEach(function (r) { reasons.appendChild(gb.el("li", {}, r)); });
    renderCandidates(d);
  }

  function costLine(c) {
    const k = c.cost || {};
    return [["pause", gb.secs(k.pause_s)], ["prepare", gb.secs(k.prepare_s)], ["KV to migrate", gb.bytes(k.kv_migrate_bytes)],
            ["tokens to replay", gb.num(k.replay_tokens, 0)], ["weights to load", gb.bytes(k.weight_load_bytes) + (k.weight_source ? " from " + k.weight_source : "")],
            ["cold start", gb.secs(k.cold_start_s)]];
  }

  function renderCandidates(d) {
    const box = document.getElementById("candidates");
    box.innerHTML = "";
    document.getElementById("no-candidates").hidden = d.candidates.length > 0;
    d.candidates.forEach(function (c, i) {
      const card = gb.el("div", { className: "candidate" + (c.gear_id === d.target_gear_id ? " chosen" : ""), "data-gear": c.gear_id });
      const head = gb.el("div", { className: "candidate-head" });
      head.appendChild(gb.el("b", {}, (i + 1) + ". " + (c.name || c.shape)));
      // one badge: what became of it in this decision (present_controls.candidate_badge)
      const chosen = c.gear_id === d.target_gear_id;
      const badge = gb.el("span", { className: "pill " + (chosen ? "pill-ok" : c.passes ? "pill-wait" : "pill-off") },
                          c.badge || (chosen ? "chosen" : c.passes ? "beat its cost" : "gain below cost × factor"));
      badge.dataset.badge = c.badge || "";
      head.appendChild(badge);
      card.appendChild(head);
      card.appendChild(gb.el("div", { className: "mono small" }, c.gear_id + (c.gpu_count ? " · " + c.gpu_count + " GPUs" : "")));
      const dl = gb.el("dl", { className: "facts tight" });
      fact(dl, "Gain", gb.num(c.gain_tokens, 0) + " tokens");
      fact(dl, "Cost", gb.num(c.cost_tokens, 0) + " tokens");
      fact(dl, "Cost × " + c.factor, gb.num(c.threshold_tokens, 0) + " tokens");
      fact(dl, "Value", gb.num(c.value_tokens_s, 0) + " tokens/s");
      const e = c.estimate || {};
      fact(dl, "Estimate", "capacity " + gb.num(e.capacity_rps, 2) + " req/s · goodput " + gb.num(e.goodput_tokens_s, 0) + " tokens/s · TTFT P99 " +
           (e.ttft_p99_s === null || e.ttft_p99_s === undefined ? "∞" : gb.ms(e.ttft_p99_s * 1000)) + " · limit " + (e.limit || "—"));
      costLine(c).forEach(function (kv) { fact(dl, kv[0], kv[1]); });
      card.appendChild(dl);
      if (c.note) card.appendChild(gb.el("p", { className: "muted small" }, c.note));
      box.appendChild(card);
    });
    const labels = d.candidates.map(function (c, i) { return (i + 1) + ". " + c.shape; });  // short: axis labels
    Plotly.react("candidates-chart", [
      { type: "bar", name: "gain", x: labels, y: d.candidates.map(function (c) { return c.gain_tokens; }), marker: { color: "#2f9e6e" } },
      { type: "bar", name: "cost × factor", x: labels, y: d.candidates.map(function (c) { return c.threshold_tokens; }), marker: { color: "#c0362c" } },
      { type: "bar", name: "cost", x: labels, y: d.candidates.map(function (c) { return c.cost_tokens; }), marker: { color: "#f0a23c" } },
    ], { barmode: "group", height: 240, margin: { l: 60, r: 10, t: 10, b: 60 }, yaxis: { title: { text: "output tokens" } },
         legend: { orientation: "h", y: -0.35 } }, { displaylogo: false, responsive: true });
  }

  // --- the transitions -------------------------------------------------------------------------------
  function section(t) {
    let card = document.querySelector("section.transition[data-seq='" + t.seq + "']");
    if (card) return card;
    card = gb.el("section", { className: "card transition", "data-seq": t.seq, "data-testid": "transition" });
    card.innerHTML =
      "<div class='card-head'><h2 class='t-title'></h2><span class='pill t-phase'></span></div>" +
      "<dl class='facts t-facts'></dl>" +
      "<div class='review-grid'><div class='plot plot-short t-phases'></div><div class='plot plot-short t-moved'></div></div>" +
      "<h3>Steps</h3><div class='plot t-steps'></div>" +
      "<table class='grid compact t-table'><thead><tr><th>Step</th><th>Phase</th><th>Attempt</th><th>State</th><th>Started</th><th>Took</th><th>Commands</th><th>What it did</th></tr></thead><tbody></tbody></table>" +
      "<div class='gears'><div class='plot plot-gear t-from'></div><div class='plot plot-gear t-to'></div></div>";
    document.getElementById("transitions").appendChild(card);
    return card;
  }

  function gpusOf(t) {
    const all = {};
    [t.from_gear_detail, t.to_gear_detail].forEach(function (g) {
      (g ? g.plans : []).forEach(function (p) { p.stages.forEach(function (s) { s.gpus.forEach(function (x) { if (x.node !== null) all[x.uuid] = x; }); }); });
    });
    return Object.values(all);
  }

  function renderTransition(t) {
    const card = section(t);
    card.dataset.phase = t.phase;
    const title = card.querySelector(".t-title");
    title.replaceChildren(data.focus === "transition" ? document.createTextNode("Transition #" + t.seq + " · " + t.kind)
                                                      : gb.link(gb.transitionUrl(t.deployment, t.seq), "Transition #" + t.seq + " · " + t.kind));
    const pill = gb.phasePill(t);
    pill.classList.add("t-phase");
    card.querySelector(".t-phase").replaceWith(pill);
    const dl = card.querySelector(".t-facts");
    dl.innerHTML = "";
    fact(dl, "Deployment", gb.link(gb.deploymentUrl(t.deployment), t.deployment));
    fact(dl, "Started", gb.when(t.created_at) + " by " + t.actor);
    fact(dl, "Took", gb.secs(t.duration_s) + (t.active ? " so far" : " · finished " + gb.when(t.finished_at)));
    fact(dl, "Gears", (t.from_gear ? t.from_gear.shape + " (" + t.from_gear.gear_id + ")" : "nothing") + " → " + t.to_gear.shape + " (" + t.to_gear.gear_id + ")");
    fact(dl, "Decision", t.decision ? gb.link(gb.decisionUrl(t.decision), "decision " + t.decision) : "—");
    const m = t.moved;
    fact(dl, "What moved", gb.bytes(m.kv_bytes_migrated) + " of KV migrated (" + m.seqs_migrated + " sequences) · " + gb.num(m.tokens_replayed, 0) +
         " tokens replayed (" + m.seqs_replayed + " sequences) · " + m.seqs_finished + " left to finish · " + m.seqs_failed + " failed · longest stall " + gb.secs(m.stall_s_max));
    if (t.abort_reason) fact(dl, "Roll back asked", t.abort_reason);
    if (t.error) fact(dl, "Error", t.error);

    const cfg = { displaylogo: false, responsive: true };
    const phases = t.phases;
    Plotly.react(card.querySelector(".t-phases"), [{
      type: "bar", orientation: "h", y: phases.map(function (p) { return p.phase; }), x: phases.map(function (p) { return p.duration_s; }),
      marker: { color: phases.map(function (p) { return gb.PHASE_COLORS[p.phase]; }) },
      text: phases.map(function (p) { return gb.secs(p.duration_s) + (p.running ? " (running)" : ""); }), textposition: "auto",
      hovertemplate: "%{y}: %{x:.3f} s<extra></extra>",
    }], { title: { text: "Phase durations (s)", font: { size: 13 } }, height: 220, margin: { l: 70, r: 10, t: 30, b: 30 },
          yaxis: { type: "category", autorange: "reversed" } }, cfg);
    card.querySelector(".t-phases").dataset.phases = phases.map(function (p) { return p.phase; }).join(",");
    Plotly.react(card.querySelector(".t-moved"), [
      { type: "bar", name: "KV migrated (MiB)", x: ["forward", "rollback"], y: [(m.forward.kv_bytes_migrated || 0) / 2 ** 20, (m.back.kv_bytes_migrated || 0) / 2 ** 20], marker: { color: "#3451b2" } },
      { type: "bar", name: "tokens replayed", x: ["forward", "rollback"], y: [m.forward.tokens_replayed || 0, m.back.tokens_replayed || 0], marker: { color: "#e07b39" }, yaxis: "y2" },
    ], { title: { text: "What moved: KV migrated vs tokens replayed", font: { size: 13 } }, height: 220, barmode: "group",
         margin: { l: 50, r: 50, t: 30, b: 30 }, yaxis: { title: { text: "MiB" } },
         yaxis2: { title: { text: "tokens" }, overlaying: "y", side: "right" }, legend: { orientation: "h", y: -0.2 } }, cfg);

    const steps = t.steps || [];
    const now = Date.now();
    const labels = steps.map(function (s) { return s.step + (s.attempt > 1 ? " (" + s.attempt + ")" : ""); });
    const stepsDiv = card.querySelector(".t-steps");
    stepsDiv.dataset.steps = String(steps.length);
    stepsDiv.classList.toggle("plot", steps.length > 0);  // no empty chart-sized gap before the first step
    card.querySelector(".t-table").hidden = !steps.length;
    if (!steps.length) {
      Plotly.purge(stepsDiv);
      stepsDiv.replaceChildren(gb.el("p", { className: "muted" }, "No step has started yet."));
    } else {
      const waiting = stepsDiv.querySelector("p.muted");
      if (waiting) waiting.remove();
    }
    if (steps.length) Plotly.react(stepsDiv, [{
      type: "bar", orientation: "h", y: labels, base: steps.map(function (s) { return s.started_at; }),
      x: steps.map(function (s) { return Math.max(30, (s.finished_at ? Date.parse(s.finished_at) : now) - Date.parse(s.started_at)); }),
      marker: { color: steps.map(function (s) { return s.state === "ok" ? gb.PHASE_COLORS[s.phase] : s.state === "running" ? "#f0c36c" : "#c0362c"; }) },
      customdata: steps.map(function (s) { return [s.phase, s.state, gb.secs(s.duration_s), s.does]; }),
      hovertemplate: "<b>%{y}</b> · %{customdata[0]} · %{customdata[1]} · %{customdata[2]}<br>%{customdata[3]}<extra></extra>",
    }], { height: Math.max(180, 24 * steps.length + 70), margin: { l: 110, r: 10, t: 10, b: 30 }, xaxis: { type: "date" },
          yaxis: { type: "category", categoryorder: "array", categoryarray: labels.slice().reverse() } }, cfg);
    const tbody = card.querySelector(".t-table tbody");
    tbody.innerHTML = "";
    steps.forEach(function (s) {
      const tr = gb.el("tr", { "data-step": s.step, "data-state": s.state });
      gb.cell(tr, s.step, "mono"); gb.cell(tr, s.phase); gb.cell(tr, s.attempt);
      gb.cell(tr, s.state + (s.reason ? " (" + s.reason + ")" : ""), s.state === "failed" ? "bad" : null);
      gb.cell(tr, gb.clock(s.started_at)); gb.cell(tr, gb.secs(s.duration_s)); gb.cell(tr, s.commands);
      gb.cell(tr, (s.note || s.does) + (s.error ? " — " + s.error : ""), "small");
      tbody.appendChild(tr);
    });
    const gpus = gpusOf(t);
    const from = card.querySelector(".t-from");
    from.hidden = !t.from_gear_detail;
    if (t.from_gear_detail) gb.gearDiagram(from, t.from_gear_detail, gpus, "from");
    gb.gearDiagram(card.querySelector(".t-to"), t.to_gear_detail, gpus, "to");
  }

  function renderTransitions() {
    const seqs = Object.keys(state.transitions).map(Number).sort(function (a, b) { return a - b; });
    seqs.forEach(function (s) { renderTransition(state.transitions[s]); });
    document.getElementById("no-transition").hidden = seqs.length > 0 || data.focus !== "decision";
  }

  renderDecision();
  renderTransitions();
  setInterval(function () {
    if (Object.values(state.transitions).some(function (t) { return t.active; })) renderTransitions();
  }, 1000);

  const approve = document.getElementById("approve-button");
  approve.addEventListener("click", function () {
    approve.disabled = true;
    gb.post("/api/v1/decisions/" + state.decision.id + "/approve", {}).then(function (r) {
      const out = document.getElementById("approve-result");
      if (r.status === 201) { out.textContent = "transition #" + r.body.seq + " started"; out.className = "small ok"; }
      else { out.textContent = gb.errorText(r.body); out.className = "small error"; approve.disabled = false; }
    });
  });

  // Live: a transition of this review (or one this decision starts) as it moves; the decision's approval.
  window.FlexPipe.live.connect("/ws/deployments/" + encodeURIComponent(data.deployment) + "/", function (msg) {
    if (msg.type === "transition") {
      const t = msg.transition;
      const mine = state.transitions[t.seq] || (state.decision && t.decision === state.decision.id);
      if (mine) { state.transitions[t.seq] = t; renderTransitions(); }
      if (state.decision && t.decision === state.decision.id && t.decision_summary) {
        state.decision.approval = t.decision_summary.approval;
        state.decision.approved_by = t.decision_summary.approved_by;
        state.decision.transitions = t.decision_summary.transitions;
        renderDecision();
      }
    } else if (msg.type === "decision" && state.decision && msg.decision.id === state.decision.id) {
      state.decision = msg.decision;
      renderDecision();
    }
  }, document.getElementById("live-status"));
})();
