// The deployment page's Blocks card: the latency-critical mark (operators), through the REST API.
// The page says "yes"/"no" only from the API's answer: a refused change leaves it as it was.
(function () {
  "use strict";
  const button = document.getElementById("latency-critical-toggle");
  if (!button) return;
  const shown = document.getElementById("latency-critical");
  const result = document.getElementById("latency-critical-result");
  button.addEventListener("click", function () {
    const want = button.dataset.value === "true";
    button.disabled = true;
    result.textContent = "…";
    FlexPipe.gb.post(button.dataset.url, { latency_critical: want }).then(function (r) {
      button.disabled = false;
      if (r.status !== 200) {
        result.textContent = "refused: " + FlexPipe.gb.errorText(r.body);
        return;
      }
      const now = !!r.body.latency_critical;
      shown.textContent = now ? "yes" : "no";
      button.dataset.value = now ? "false" : "true";
      button.textContent = now ? "Unmark" : "Mark latency-critical";
      result.textContent = "saved";
    });
  });
})();
