// The Deployments page: every deployment with its gear and health, and the recent switches as a
// Gantt of phases; /ws/gearbox/ keeps both current without reloading.
(function () {
  "use strict";
  const gb = window.FlexPipe.gb;
  const data = JSON.parse(document.getElementById("deployments-data").textContent);
  const state = { deployments: data.deployments, switches: {} };
  data.switches.forEach(function (t) { state.switches[t.id] = t; });
  window.FlexPipe.deployments = state;

  function renderDeployments() {
    gb.deploymentsTable(document.querySelector("#deployments tbody"), state.deployments);
    document.getElementById("deployments-empty").hidden = state.deployments.length > 0;
  }

  function renderSwitches() {
    const rows = Object.values(state.switches).sort(function (a, b) { return b.id - a.id; }).slice(0, 12);
    gb.gantt(document.getElementById("switch-timeline"), rows, { withDeployment: true });
    gb.transitionsTable(document.querySelector("#switches tbody"), rows, { withDeployment: true });
  }

  renderDeployments();
  renderSwitches();
  // running phases grow with the clock
  setInterval(function () {
    if (Object.values(state.switches).some(function (t) { return t.active; })) renderSwitches();
  }, 1000);

  // Operators: the "New deployment" form posts to the API and shows its answer - the refusal's own
  // words under each field it names, never a success the API did not give.
  const form = document.getElementById("new-deployment-form");
  if (form) {
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      form.querySelectorAll(".field-error").forEach(function (el) { el.remove(); });
      const result = document.getElementById("new-deployment-result");
      const body = { name: form.elements.name.value.trim(), mode: form.elements.mode.value };
      const version = form.elements.model_version.value;
      body.model_version = version === "" ? null : Number(version);
      ["ttft_ms", "tpot_ms", "priority", "min_replicas", "max_replicas", "idle_to_zero_s"].forEach(function (k) {
        const raw = form.elements[k].value.trim();
        if (raw !== "") body[k] = Number(raw);
      });
      const gear = form.elements.baseline_gear.value.trim() || "auto";
      body.baseline_gear = gear;
      if (gear.startsWith("{")) {
        try { body.baseline_gear = JSON.parse(gear); } catch (e) { body.baseline_gear = gear; }
      }
      const token = form.querySelector("[name=csrfmiddlewaretoken]").value;
      result.textContent = "creating…"; result.className = "";
      fetch("/api/v1/deployments", {
        method: "POST", credentials: "same-origin", body: JSON.stringify(body),
        headers: { "Content-Type": "application/json", Accept: "application/json", "X-CSRFToken": token },
      }).then(function (r) {
        return r.json().catch(function () { return { detail: r.statusText }; })
          .then(function (j) { return { status: r.status, body: j }; });
      }).then(function (res) {
        if (res.status === 201) {
          const gearShape = res.body.baseline_gear ? res.body.baseline_gear.shape : "";
          result.textContent = "created " + res.body.name + " (baseline " + gearShape + "): it comes up on the next tick";
          result.className = "ok";
          state.deployments = state.deployments.filter(function (d) { return d.name !== res.body.name; })
            .concat([res.body]);
          renderDeployments();
          return;
        }
        result.textContent = "refused (" + res.status + ")"; result.className = "bad";
        Object.keys(res.body || {}).forEach(function (field) {
          const reasons = [].concat(res.body[field]).join("; ");
          const input = form.elements[field.split(/[.[]/)[0]];
          const p = document.createElement("div");
          p.className = "field-error bad"; p.dataset.field = field;
          p.textContent = (input && field === input.name ? "" : field + ": ") + reasons;
          if (input && input.parentElement) input.parentElement.appendChild(p);
          else result.after(p);
        });
      }).catch(function (e) {
        result.textContent = "not sent: " + e; result.className = "bad";
      });
    });
  }

  window.FlexPipe.live.connect("/ws/gearbox/", function (msg) {
    if (msg.type === "snapshot" || msg.type === "deployments") {
      state.deployments = msg.deployments;
      renderDeployments();
    }
    if (msg.type === "snapshot") {
      state.switches = {};
      msg.switches.forEach(function (t) { state.switches[t.id] = t; });
      renderSwitches();
    } else if (msg.type === "switch") {
      state.switches[msg.transition.id] = msg.transition;
      renderSwitches();
    }
  }, document.getElementById("live-status"));
})();
