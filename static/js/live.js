// A websocket that reconnects by itself and says how it is doing in a status pill.
// Each page gives it a path and a handler; the handler receives parsed JSON messages.
// The server pings every few seconds ({"type": "ping", "every_s"}, console/dashboard/consumers.py):
// pings never reach the handler, and a connection silent for three ping periods is taken as dead
// and reopened. `FlexPipe.live.stats` counts opens and closes (the idle-page test reads it).
// Every message is acknowledged once handled ({"type": "ack", "count": messages so far}): a page
// that falls behind (a frozen tab, a slow link) is closed by the server with 4409 and starts over
// here from a fresh snapshot, instead of the server buffering for it without end.
(function () {
  "use strict";
  const stats = { opens: 0, closes: [], pings: 0, resyncs: 0 };
  const RESYNC = 4409;  // console/dashboard/consumers.py RESYNC_CLOSE
  function connect(path, onMessage, statusEl) {
    let delay = 500;
    let watchdog = null;
    function setStatus(state, text) {
      if (!statusEl) return;
      statusEl.dataset.state = state;
      statusEl.textContent = text;
      statusEl.className = "pill " + (state === "live" ? "pill-ok" : state === "closed" || state === "degraded" ? "pill-bad" : "pill-wait");
    }
    function open() {
      const scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
      const ws = new WebSocket(scheme + window.location.host + path);
      function watch(everyS) {
        clearTimeout(watchdog);
        watchdog = setTimeout(function () { ws.close(4000, "no ping for three periods"); }, 3000 * everyS);
      }
      let received = 0;
      ws.onopen = function () { delay = 500; stats.opens += 1; setStatus("live", "live"); };
      ws.onmessage = function (ev) {
        received += 1;
        const msg = JSON.parse(ev.data);
        if (msg.type === "ping") { stats.pings += 1; watch(msg.every_s); }
        // the server lost its channel layer (Redis): updates stop until the reconnect's snapshot
        else if (msg.type === "degraded") { setStatus("degraded", "degraded — reconnecting"); }
        else { onMessage(msg, ws); }
        if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "ack", count: received }));
      };
      ws.onclose = function (ev) {
        clearTimeout(watchdog);
        stats.closes.push({ at: new Date().toISOString(), code: ev.code });
        if (ev.code === 4401 || ev.code === 4403) { setStatus("closed", "not allowed — log in again"); return; }
        if (ev.code === RESYNC) {
          // fell behind: reconnect at once; the snapshot on connect replaces what the page holds
          stats.resyncs += 1;
          setStatus("connecting", "fell behind — resyncing…");
          setTimeout(open, 0);
          return;
        }
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
  window.FlexPipe.live = { connect: connect, stats: stats };
})();
