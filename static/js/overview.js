// The Overview's gearbox part: each deployment's gear and health, the recent switches, and (handed
// to cluster.js) the atomic blocks the heatmap is grouped by and what runs on each GPU - all from
// /ws/gearbox/, without reloading.
(function () {
  "use strict";
  const gb = window.FlexPipe.gb;
  const cluster = window.FlexPipe.cluster;
  const state = { deployments: [], switches: {} };
  window.FlexPipe.overview = state;

  function blocksOf(msg) { return msg.blocks ? { blocks: msg.blocks, excluded: msg.excluded } : null; }

  function renderDeployments() {
    gb.deploymentsTable(document.querySelector("#overview-deployments tbody"), state.deployments);
    document.getElementById("overview-deployments-empty").hidden = state.deployments.length > 0;
  }

  function renderSwitches() {
    const rows = Object.values(state.switches).sort(function (a, b) { return b.id - a.id; }).slice(0, 8);
    gb.transitionsTable(document.querySelector("#recent-switches tbody"), rows, { withDeployment: true });
    document.getElementById("recent-switches-empty").hidden = rows.length > 0;
  }

  function blockError(msg) {
    const p = document.getElementById("block-error");
    p.hidden = !msg.fleet_error;
    p.textContent = msg.fleet_error || "";
  }

  window.FlexPipe.live.connect("/ws/gearbox/", function (msg) {
    if (msg.type === "snapshot") {
      state.deployments = msg.deployments;
      state.switches = {};
      msg.switches.forEach(function (t) { state.switches[t.id] = t; });
      cluster.setGearbox(blocksOf(msg), msg.holders, msg.gpu_twu);
      blockError(msg);
      renderDeployments();
      renderSwitches();
    } else if (msg.type === "fleet") {
      cluster.setGearbox(blocksOf(msg));
      blockError(msg);
    } else if (msg.type === "deployments") {
      state.deployments = msg.deployments;
      cluster.setGearbox(undefined, msg.holders, msg.gpu_twu);
      renderDeployments();
    } else if (msg.type === "switch") {
      state.switches[msg.transition.id] = msg.transition;
      renderSwitches();
    }
  }, document.getElementById("gearbox-status"));
})();
