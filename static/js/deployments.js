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
