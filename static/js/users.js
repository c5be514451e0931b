// The Users page (admins): users with their role, whether they may log in, and their API tokens;
// every change is a call of /api/v1/users (the API checks the role and audits it).
(function () {
  "use strict";
  const gb = window.FlexPipe.gb;
  const data = JSON.parse(document.getElementById("users-data").textContent);
  const state = { users: {} };
  window.FlexPipe.users = state;

  function say(id, text, ok) {
    const out = document.getElementById(id);
    out.textContent = text;
    out.className = "small " + (ok ? "ok" : "error");
  }

  function call(path, body, done) {
    return gb.post("/api/v1/users" + path, body).then(function (r) {
      if (r.status >= 200 && r.status < 300) {
        if (r.body && r.body.username) { state.users[r.body.username] = r.body; render(); }
        say("users-result", done(r), true);
      } else {
        say("users-result", "refused: " + gb.errorText(r.body), false);
        render();  // put the controls back as the server holds them
      }
      return r;
    });
  }

  function tokensCell(td, u) {
    const live = u.tokens.filter(function (t) { return !t.revoked_at; });
    live.forEach(function (t) {
      const line = gb.el("div", { className: "small", "data-token": t.id });
      line.appendChild(document.createTextNode(t.name + " · " + t.prefix + "… · " +
        (t.last_used_at ? "used " + gb.relative(t.last_used_at) : "never used") + " "));
      const revoke = gb.el("button", { type: "button", className: "small ghost revoke" }, "Revoke");
      revoke.addEventListener("click", function () {
        call("/" + encodeURIComponent(u.username) + "/revoke-token", { token_id: t.id },
             function () { return "revoked " + t.prefix + "… of " + u.username; });
      });
      line.appendChild(revoke);
      td.appendChild(line);
    });
    if (!live.length) td.appendChild(gb.el("span", { className: "muted small" }, "none"));
  }

  function row(u) {
    const tr = gb.el("tr", { "data-user": u.username, "data-role": u.role || "", "data-active": String(u.active) });
    gb.cell(tr, u.username + (u.username === data.me ? " (you)" : ""), "strong");
    const role = gb.el("select", { className: "role" });
    data.roles.concat([""]).forEach(function (r) {
      const o = gb.el("option", { value: r }, r || "none");
      if ((u.role || "") === r) o.selected = true;
      role.appendChild(o);
    });
    role.addEventListener("change", function () {
      call("/" + encodeURIComponent(u.username) + "/role", { role: role.value || null },
           function (r) { return u.username + " is now " + (r.body.role || "without a role"); });
    });
    gb.cell(tr, role);
    const active = gb.el("button", { type: "button", className: "small " + (u.active ? "ghost" : ""), "data-action": "active" },
                         u.active ? "Deactivate" : "Activate");
    active.addEventListener("click", function () {
      call("/" + encodeURIComponent(u.username) + "/active", { active: !u.active },
           function (r) { return u.username + (r.body.active ? " may log in again" : " is locked out (session and tokens)"); });
    });
    const td = gb.cell(tr, u.active ? "yes " : "no ");
    td.appendChild(active);
    gb.cell(tr, u.last_login ? gb.timeEl(u.last_login) : "never");
    tokensCell(gb.cell(tr, ""), u);
    const issue = gb.el("button", { type: "button", className: "small", "data-action": "issue" }, "Issue token");
    issue.addEventListener("click", function () {
      const name = window.prompt("What is the token for? (e.g. grafana)", "script");
      if (!name) return;
      gb.post("/api/v1/users/" + encodeURIComponent(u.username) + "/tokens", { name: name }).then(function (r) {
        if (r.status !== 201) { say("users-result", "refused: " + gb.errorText(r.body), false); return; }
        say("users-result", "token for " + u.username + " (shown this once, copy it now): " + r.body.token, true);
        document.getElementById("users-result").dataset.token = r.body.token;
        refresh(u.username);
      });
    });
    gb.cell(tr, issue);
    return tr;
  }

  function refresh(username) {
    fetch("/api/v1/users/" + encodeURIComponent(username), { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { return r.json(); }).then(function (u) { state.users[u.username] = u; render(); });
  }

  function render() {
    const tbody = document.querySelector("#users tbody");
    tbody.innerHTML = "";
    Object.values(state.users).sort(function (a, b) { return a.username.localeCompare(b.username); })
      .forEach(function (u) { tbody.appendChild(row(u)); });
  }

  data.users.forEach(function (u) { state.users[u.username] = u; });
  render();

  const form = document.getElementById("user-form");
  form.addEventListener("submit", function (ev) {
    ev.preventDefault();
    const body = { username: form.username.value.trim(), password: form.password.value, role: form.role.value || null };
    gb.post("/api/v1/users", body).then(function (r) {
      if (r.status === 201) {
        state.users[r.body.username] = r.body; render(); form.reset();
        say("user-form-result", r.body.username + " added as " + (r.body.role || "no role"), true);
      } else {
        say("user-form-result", "refused: " + gb.errorText(r.body), false);
      }
    });
  });
})();
