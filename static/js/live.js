// A websocket that reconnects by itself and says how it is doing in a status pill.
// Each page gives it a path and a handler; the handler receives parsed JSON messages.
(function () {
  "use strict";
  function connect(path, onMessage, statusEl) {
    let delay = 500;
    function setStatus(state, text) {
      if (!statusEl) return;
      statusEl.dataset.state = state;
      statusEl.textContent = text;
      statusEl.className = "pill " + (state === "live" ? "pill-ok" : state === "closed" || state === "degraded" ? "pill-bad" : "pill-wait");
    }
    function open() {
      const scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
      const ws = new WebSocket(scheme + window.location.host + path);
      ws.onopen = function () { delay = 500; setStatus("live", "live"); };
      ws.onmessage = function (ev) {
        const msg = JSON.parse(ev.data);
        // the server lost its channel layer (Redis): updates stop until the reconnect's snapshot
        if (msg.type === "degraded") { setStatus("degraded", "degraded — reconnecting"); return; }
        onMessage(msg, ws);
      };
      ws.onclose = function (ev) {
        if (ev.code === 4401 || ev.code === 4403) { setStatus("closed", "not allowed — log in again"); return; }
        if (ev.code === 1013 || statusEl && statusEl.dataset.state === "degraded") {
          setStatus("degraded", "degraded — reconnecting");
        } else {
          setStatus("connecting", "reconnecting…");
        }
        setTimeout(open, delay);
        delay = Math.min(delay * 2, 10000);
      };
    }
    open();
  }
  window.FlexPipe = window.FlexPipe || {};
  window.FlexPipe.live = { connect: connect };
})();
