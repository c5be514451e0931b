// The Audit page: the entries the server rendered, filtered like the API filters them, plus every
// new entry that the /ws/audit/ websocket pushes (if it matches the filters), without reloading.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("audit-data").textContent);
  const filters = data.filters;
  const state = { entries: {}, headSeq: data.head_seq, live: 0 };
  window.FlexPipe = window.FlexPipe || {};
  window.FlexPipe.audit = state;

  function prefixOrExact(pattern, value) {
    if (!pattern) return true;
    return pattern.endsWith("*") ? value.startsWith(pattern.slice(0, -1)) : value === pattern;
  }

  // The same rules as console/audit/api.py filter_entries, for entries that arrive live.
  function matches(e) {
    if (!prefixOrExact(filters.type, e.event_type)) return false;
    if (!prefixOrExact(filters.actor, e.actor)) return false;
    if (filters.deployment && e.deployment !== filters.deployment) return false;
    const at = Date.parse(e.at);
    if (filters.since && at < Date.parse(filters.since)) return false;
    if (filters.until && at >= Date.parse(filters.until)) return false;
    if (filters.after_seq && e.seq <= Number(filters.after_seq)) return false;
    if (filters.before_seq && e.seq >= Number(filters.before_seq)) return false;  // an older page: nothing new lands on it
    return true;
  }

  function fmtTime(iso) { return iso.replace("T", " ").replace(/\.\d+/, "").replace("+00:00", "Z"); }

  function detailText(e) {
    const parts = [];
    if (e.before !== null && e.before !== undefined) parts.push("before: " + JSON.stringify(e.before, null, 2));
    if (e.after !== null && e.after !== undefined) parts.push("after:  " + JSON.stringify(e.after, null, 2));
    parts.push("data:   " + JSON.stringify(e.data, null, 2));
    parts.push("hash " + e.hash + "\nprev " + e.prev_hash);
    return parts.join("\n");
  }

  function link(href, text, kind) {
    const a = document.createElement("a");
    a.href = href; a.textContent = text; a.dataset.link = kind;
    a.addEventListener("click", function (ev) { ev.stopPropagation(); });  // a link, not the row's detail
    const span = document.createElement("div");
    span.appendChild(a);
    return span;
  }

  function row(e, fresh) {
    const tr = document.createElement("tr");
    tr.dataset.seq = String(e.seq);
    tr.dataset.type = e.event_type;
    tr.className = "entry" + (fresh ? " fresh" : "");
    [String(e.seq), fmtTime(e.at), e.event_type, e.actor, e.deployment || "—", e.summary].forEach(function (text, i) {
      const td = document.createElement("td");
      td.textContent = text;
      if (i === 2) td.className = "mono";
      tr.appendChild(td);
    });
    // what the entry is about: its transition's and its decision's review pages
    const links = document.createElement("td");
    links.className = "links small";
    if (e.deployment && e.transition_seq) {
      links.appendChild(link("/deployments/" + encodeURIComponent(e.deployment) + "/transitions/" + e.transition_seq + "/",
                             "transition #" + e.transition_seq, "transition"));
    }
    if (e.decision_id) links.appendChild(link("/decisions/" + e.decision_id + "/", "decision " + e.decision_id, "decision"));
    tr.appendChild(links);
    tr.addEventListener("click", function () {
      const next = tr.nextElementSibling;
      if (next && next.classList.contains("detail")) { next.remove(); return; }
      const d = document.createElement("tr");
      d.className = "detail";
      const td = document.createElement("td");
      td.colSpan = 7;
      const pre = document.createElement("pre");
      pre.textContent = detailText(e);
      td.appendChild(pre);
      d.appendChild(td);
      tr.after(d);
    });
    return tr;
  }

  function add(e, fresh) {
    if (state.entries[e.seq] || !matches(e)) return false;
    state.entries[e.seq] = e;
    const tbody = document.querySelector("#audit-table tbody");
    // Newest first: insert before the first row with a smaller seq.
    const rows = tbody.querySelectorAll("tr.entry");
    let before = null;
    for (const r of rows) { if (Number(r.dataset.seq) < e.seq) { before = r; break; } }
    tbody.insertBefore(row(e, fresh), before);
    return true;
  }

  function refresh() {
    const all = Object.values(state.entries);
    document.getElementById("audit-empty").hidden = all.length > 0;
    const byType = {};
    all.forEach(function (e) { (byType[e.event_type] = byType[e.event_type] || []).push(e.at); });
    const traces = Object.keys(byType).sort().map(function (t) {
      return { type: "histogram", name: t, x: byType[t], hovertemplate: "%{y} × " + t + "<extra></extra>" };
    });
    Plotly.react("audit-chart", traces, {
      barmode: "stack", height: 220, margin: { l: 40, r: 10, t: 10, b: 40 }, showlegend: true,
      legend: { orientation: "h", y: -0.25 }, xaxis: { type: "date" }, yaxis: { title: { text: "entries" } },
    }, { displaylogo: false, responsive: true });
  }

  function setChain(status) {
    const el = document.getElementById("chain-status");
    if (status === null) { el.dataset.state = "error"; el.className = "pill pill-wait"; el.textContent = "could not verify"; return; }
    el.dataset.state = status.ok ? "ok" : "broken";
    el.dataset.checked = String(status.checked);
    el.className = "pill " + (status.ok ? "pill-ok" : "pill-bad");
    el.textContent = status.ok ? "chain intact · " + status.checked + " entries verified"
                               : "chain broken at #" + status.first_bad_seq + ": " + status.reason;
  }

  function verify() {
    const el = document.getElementById("chain-status");
    el.dataset.state = "checking"; el.className = "pill pill-wait"; el.textContent = "checking the chain…";
    fetch("/api/v1/audit/verify", { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(setChain)
      .catch(function () { setChain(null); });
  }

  // Entries appended while the websocket was (re)connecting: fetch them by seq, with the page's filters.
  function catchUp(after) {
    const params = new URLSearchParams(filters);
    params.set("after_seq", String(after));
    params.set("limit", "1000");
    fetch("/api/v1/audit?" + params.toString(), { credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : { results: [] }; })
      .then(function (page) {
        let any = false;
        page.results.forEach(function (e) { any = add(e, true) || any; });
        if (any) refresh();
      });
  }

  data.entries.forEach(function (e) { add(e, false); });
  refresh();
  verify();
  document.getElementById("verify-again").addEventListener("click", verify);

  window.FlexPipe.live.connect("/ws/audit/", function (msg) {
    if (msg.type === "hello") {
      if (msg.head_seq > state.headSeq) catchUp(state.headSeq);
      state.headSeq = Math.max(state.headSeq, msg.head_seq);
    } else if (msg.type === "entry") {
      state.headSeq = Math.max(state.headSeq, msg.entry.seq);
      state.live += 1;
      if (add(msg.entry, true)) refresh();
    }
  }, document.getElementById("live-status"));
})();
