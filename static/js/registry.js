// The Registry page: every model version with its hash status, kept current by /ws/registry/.
// Admins also get the register form and a retire button per version; the API checks the role anyway.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("registry-data").textContent);
  const canAdmin = data.can_admin;
  const canOperate = data.can_operate;
  const state = { versions: {} };
  window.FlexPipe = window.FlexPipe || {};
  window.FlexPipe.registry = state;

  const STATUS_PILL = { verified: "pill-ok", verifying: "pill-wait", awaiting_agent: "pill-wait",
                        quarantined: "pill-bad", retired: "pill-off" };
  const STATUS_TEXT = { verified: "verified", verifying: "verifying…", awaiting_agent: "awaiting agent",
                        quarantined: "quarantined", retired: "retired" };

  function csrfToken() {
    const el = document.querySelector("[name=csrfmiddlewaretoken]");  // the page's own token (every role)
    return el ? el.value : "";
  }

  function post(url, body) {
    return fetch(url, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", Accept: "application/json", "X-CSRFToken": csrfToken() },
      body: JSON.stringify(body),
    }).then(function (r) { return r.json().then(function (j) { return { status: r.status, body: j }; }); });
  }

  function short(hex) { return hex ? hex.slice(0, 12) + "…" : ""; }
  function when(iso) { return iso ? iso.replace("T", " ").replace(/\.\d+/, "").replace(/(\+00:00|Z)$/, "Z") : ""; }

  function arch(a) {
    if (typeof a === "string") return a;
    const name = (a.architectures && a.architectures[0]) || a.model_type || "HF config";
    return name + " (" + a.num_hidden_layers + " layers, hidden " + a.hidden_size + ")";
  }

  function cell(tr, text, cls, title) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    if (title) td.title = title;
    tr.appendChild(td);
    return td;
  }

  function checkText(v) {
    if (v.status === "quarantined" && v.observed_sha256) {
      return "observed " + short(v.observed_sha256) + " ≠ registered " + short(v.sha256) + " · " +
             v.quarantined_by + " · " + when(v.quarantined_at);
    }
    if (v.status === "quarantined") return v.status_detail + " · " + when(v.quarantined_at);
    if (v.verified_at) return "matched · " + v.verified_by + " · " + when(v.verified_at);
    return v.status_detail;
  }

  function retireControls(td, v) {
    td.innerHTML = "";
    if (v.status === "retired") return;
    const btn = document.createElement("button");
    btn.type = "button"; btn.className = "danger small retire"; btn.textContent = "Retire";
    btn.addEventListener("click", function () {
      td.innerHTML = "";
      const reason = document.createElement("input");
      reason.placeholder = "reason (optional)"; reason.className = "retire-reason";
      const yes = document.createElement("button");
      yes.type = "button"; yes.className = "danger small confirm-retire"; yes.textContent = "Confirm retire";
      const no = document.createElement("button");
      no.type = "button"; no.className = "ghost small"; no.textContent = "Cancel";
      no.addEventListener("click", function () { retireControls(td, state.versions[v.id]); });
      yes.addEventListener("click", function () {
        yes.disabled = true;
        post("/api/v1/models/" + v.id + "/retire", { reason: reason.value }).then(function (res) {
          if (res.status === 200) { upsert(res.body); return; }
          retireControls(td, state.versions[v.id]);
          say(td, "refused: " + errorText(res.body), false);
        });
      });
      td.append(reason, yes, no);
    });
    td.appendChild(btn);
  }

  function errorText(body) {
    return Object.keys(body || {}).map(function (k) { return k + ": " + [].concat(body[k]).join("; "); }).join(" · ");
  }

  function say(td, text, ok) {
    const out = document.createElement("div");
    out.className = "small result " + (ok ? "ok" : "bad");
    out.setAttribute("role", "status");
    out.textContent = text;
    td.appendChild(out);
    return out;
  }

  // Roll a version out to one of its model's deployments that does not serve it yet.
  function rolloutControls(td, v) {
    const targets = (v.deployments || []).filter(function (d) { return (v.serving || []).indexOf(d) < 0; });
    if (v.status !== "verified" && v.status !== "awaiting_agent") return;
    if (!targets.length) return;
    const select = document.createElement("select");
    select.className = "rollout-target";
    targets.forEach(function (d) { const o = document.createElement("option"); o.value = d; o.textContent = d; select.appendChild(o); });
    const btn = document.createElement("button");
    btn.type = "button"; btn.className = "small rollout"; btn.textContent = "Roll out to";
    btn.addEventListener("click", function () {
      btn.disabled = true;
      td.querySelectorAll(".result").forEach(function (n) { n.remove(); });
      post("/api/v1/deployments/" + encodeURIComponent(select.value) + "/rollout", { version: v.id }).then(function (res) {
        btn.disabled = false;
        if (res.status === 201) {
          const out = say(td, "", true);
          const a = document.createElement("a");
          a.href = "/deployments/" + encodeURIComponent(select.value) + "/transitions/" + res.body.seq + "/";
          a.textContent = "rollout #" + res.body.seq + " to " + select.value + " started (canary first)";
          out.appendChild(a);
          out.dataset.seq = String(res.body.seq);
        } else if (res.status === 200) {
          say(td, select.value + ": " + (res.body.state === "bound" ? "serves it from its first gear on" : "serves it already"), true);
        } else {
          say(td, "refused: " + errorText(res.body), false);
        }
      });
    });
    td.append(btn, select);
  }

  function row(v) {
    const tr = document.createElement("tr");
    tr.dataset.id = String(v.id);
    tr.dataset.status = v.status;
    cell(tr, v.name, "strong");
    cell(tr, v.version);
    cell(tr, v.engine);
    cell(tr, arch(v.architecture));
    cell(tr, short(v.sha256), "mono", v.sha256);
    const st = cell(tr, "");
    const pill = document.createElement("span");
    pill.className = "pill status " + (STATUS_PILL[v.status] || "");
    pill.dataset.status = v.status;
    pill.textContent = STATUS_TEXT[v.status] || v.status;
    st.appendChild(pill);
    cell(tr, checkText(v), v.status === "quarantined" ? "bad check" : "check", v.status_detail);
    cell(tr, when(v.registered_at) + " · " + v.registered_by, "muted");
    cell(tr, (v.serving || []).join(", ") || "—", "serving");
    if (canOperate) {
      const td = cell(tr, "", "actions");
      rolloutControls(td, v);
      if (canAdmin) { const span = document.createElement("span"); td.appendChild(span); retireControls(span, v); }
    }
    return tr;
  }

  function render() {
    const list = Object.values(state.versions).sort(function (a, b) {
      return a.name === b.name ? (b.registered_at || "").localeCompare(a.registered_at || "") : a.name.localeCompare(b.name);
    });
    const tbody = document.querySelector("#versions tbody");
    tbody.innerHTML = "";
    list.forEach(function (v) { tbody.appendChild(row(v)); });
    document.getElementById("versions-empty").hidden = list.length > 0;
    const counts = {};
    list.forEach(function (v) { counts[v.status] = (counts[v.status] || 0) + 1; });
    const box = document.getElementById("status-counts");
    box.innerHTML = "";
    Object.keys(STATUS_TEXT).forEach(function (s) {
      if (!counts[s]) return;
      const p = document.createElement("span");
      p.className = "pill " + STATUS_PILL[s]; p.dataset.status = s;
      p.textContent = counts[s] + " " + STATUS_TEXT[s];
      box.appendChild(p);
    });
  }

  function upsert(v) { state.versions[v.id] = v; render(); }

  data.versions.forEach(function (v) { state.versions[v.id] = v; });
  render();

  const form = document.getElementById("register-form");
  if (form) {
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      form.querySelectorAll(".field-error").forEach(function (el) { el.remove(); });
      const result = document.getElementById("register-result");
      const body = {};
      ["name", "version", "engine", "weights_uri", "sha256", "tokenizer"].forEach(function (k) { body[k] = form.elements[k].value.trim(); });
      ["max_context", "min_gpu_mem_bytes", "warmup_tokens"].forEach(function (k) {
        const raw = form.elements[k].value.trim();
        body[k] = raw === "" ? null : Number(raw);
      });
      const archRaw = form.elements.architecture.value.trim();
      body.architecture = archRaw;
      if (archRaw.startsWith("{")) {
        try { body.architecture = JSON.parse(archRaw); } catch (e) { body.architecture = archRaw; }
      }
      result.textContent = "registering…"; result.className = "";
      post("/api/v1/models", body).then(function (res) {
        if (res.status === 201 || res.status === 200) {
          upsert(res.body);
          result.textContent = res.body.name + " " + res.body.version + ": " + (STATUS_TEXT[res.body.status] || res.body.status);
          result.className = res.body.status === "quarantined" ? "bad" : "ok";
          return;
        }
        result.textContent = "refused (" + res.status + ")"; result.className = "bad";
        Object.keys(res.body).forEach(function (field) {
          const reasons = [].concat(res.body[field]).join("; ");
          const input = form.elements[field];
          const p = document.createElement("div");
          p.className = "field-error bad"; p.dataset.field = field;
          p.textContent = (input ? "" : field + ": ") + reasons;
          if (input && input.parentElement) input.parentElement.appendChild(p);
          else result.after(p);
        });
      });
    });
  }

  window.FlexPipe.live.connect("/ws/registry/", function (msg) {
    if (msg.type === "snapshot") { state.versions = {}; msg.versions.forEach(function (v) { state.versions[v.id] = v; }); render(); }
    else if (msg.type === "version") upsert(msg.version);
  }, document.getElementById("live-status"));
})();
