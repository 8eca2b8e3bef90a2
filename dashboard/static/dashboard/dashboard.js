// The dashboard's only script: a live task list (polled) and a live task page (SSE).
// Client contract of the stream: docs/streaming.md (snapshot first, seq de-duplication,
// re-read the snapshot on a gap). A 401/403 from the server means the session ended:
// the person goes to sign in, and comes back here after.
"use strict";
window.Dashboard = (() => {
  const percent = (p) => Math.round((p || 0) * 100);

  function signIn() {
    const next = location.pathname + location.search;
    location.assign(document.body.dataset.login + "?next=" + encodeURIComponent(next));
  }

  // GET one of the dashboard's JSON or fragment URLs: the response when it is usable, null
  // otherwise (a failed request is left to the caller's next try; it may throw offline).
  async function get(url) {
    const response = await fetch(url, {credentials: "same-origin"});
    if (response.status === 401 || response.status === 403) { signIn(); return null; }
    return response.ok ? response : null;
  }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "text") node.textContent = v; else node.setAttribute(k, v);
    }
    for (const child of children) node.append(child);
    return node;
  }

  function liveList(table) {
    const tbody = table.tBodies[0];
    function render(tasks) {
      if (!tasks.length) {
        tbody.replaceChildren(el("tr", {class: "empty"}, el("td", {colspan: "7", text: "No tasks yet."})));
        return;
      }
      tbody.replaceChildren(...tasks.map((t) => {
        const bar = el("progress", {max: "1", value: String(t.progress)});
        return el("tr", {"data-task": t.taskId},
          el("td", {}, el("a", {href: t.url, text: t.taskId.slice(0, 12) + "…"}), " ",
             el("span", {class: "muted", text: (t.goal || "").slice(0, 40)})),
          el("td", {text: t.tenant}), el("td", {text: t.agent}),
          el("td", {}, el("span", {class: "badge " + t.runtimeStatus, "data-testid": "row-status", text: t.runtimeStatus})),
          el("td", {}, bar, " ", el("span", {"data-testid": "row-progress", text: percent(t.progress) + "%"})),
          el("td", {text: t.phase}), el("td", {class: "muted", text: t.updatedAt.slice(0, 19)}));
      }));
    }
    // Polled, not streamed: the list is one cheap query, and the tenant-wide changes it shows
    // have no stream of their own. "updated Ns ago" says how fresh it is, and grows when polls fail.
    const updated = document.querySelector("[data-testid=list-updated]");
    let fetchedAt = Date.now();
    function age() {
      const seconds = Math.floor((Date.now() - fetchedAt) / 1000);
      updated.textContent = seconds < 3 ? "updated just now" : `updated ${seconds}s ago`;
      updated.classList.toggle("stale", seconds >= 10);
    }
    async function refresh() {
      try {
        const response = await get(table.dataset.source);
        if (response) { render((await response.json()).tasks); fetchedAt = Date.now(); age(); }
      } catch (e) { /* offline for a moment: the next poll tries again */ }
      setTimeout(refresh, 2000);
    }
    setTimeout(refresh, 2000);
    setInterval(age, 1000);
  }

  function liveTask(root, firstSeq) {
    let last = firstSeq;  // the page was rendered at this seq
    const field = (name) => root.querySelector(`[data-testid="${name}"]`);
    const panels = root.querySelector("#panels");
    const log = root.querySelector("#log");

    function renderProgress(progress, phase, message) {
      const value = percent(progress);
      field("progressbar").setAttribute("aria-valuenow", String(value));
      field("progressbar").firstElementChild.style.width = value + "%";
      field("progress").textContent = String(value);
      if (phase !== undefined && phase !== null) field("phase").textContent = phase || "—";
      if (message !== undefined && message !== null) field("status-message").textContent = message;
    }

    // Snapshot and panel requests overlap and may be answered out of order (a busy server):
    // a late answer must never paint older state over newer.
    let shown = firstSeq;  // seq of the newest snapshot on screen
    function renderSnapshot(s) {
      if (s.seq < shown) return false;
      shown = s.seq;
      if (s.seq >= last) {  // else a newer progress event has already moved the bar
        renderProgress(s.progress, s.phase, s.statusMessage);
        field("steps").textContent = String(s.stepsDone);
      }
      const status = field("status");
      status.textContent = s.runtimeStatus;
      status.className = "badge " + s.runtimeStatus;
      field("version").textContent = String(s.stateVersion);
      field("recoveries").textContent = String(s.recoveries);
      field("recoveries-in-a-row").textContent = String(s.recoveriesInARow);
      field("priority").textContent = String(s.priority);
      field("goal-title").textContent = s.goal || s.agent;
      return true;
    }

    // The panels (controls with their expectedVersion, inputs, timelines) are server-rendered;
    // re-read them when control state changes, but never under someone's typing, and keep
    // what they typed or picked and have not sent yet (a new goal, a reason, a priority).
    const typing = () => {
      const active = document.activeElement;
      return active && panels.contains(active) && ["INPUT", "SELECT", "TEXTAREA"].includes(active.tagName);
    };
    const formKey = (field) => field.form.getAttribute("action") + "|" + (field.form.elements.namedItem("type")?.value || "");
    const initial = (field) => field.tagName === "SELECT"
      ? ([...field.options].find((o) => o.defaultSelected) || field.options[0])?.value
      : field.type === "checkbox" ? field.defaultChecked : field.defaultValue;
    const current = (field) => field.type === "checkbox" ? field.checked : field.value;
    function unsent() {
      return [...panels.querySelectorAll("form input:not([type=hidden]), form select, form textarea")]
        .filter((field) => current(field) !== initial(field))
        .map((field) => [formKey(field), field.name, current(field)]);
    }
    function restore(kept) {
      for (const [key, name, value] of kept) {
        const field = [...panels.querySelectorAll(`[name="${name}"]`)].find((f) => f.form && formKey(f) === key);
        if (field && field.type === "checkbox") field.checked = value; else if (field) field.value = value;
      }
    }
    let panelsPending = false;
    let panelsAsked = 0;
    async function refreshPanels() {
      if (typing()) { panelsPending = true; return; }
      panelsPending = false;
      const asked = ++panelsAsked;
      const response = await get(root.dataset.panels);
      if (!response) return;
      const html = await response.text();
      if (asked !== panelsAsked) return;  // a newer request's answer will come
      if (typing()) { panelsPending = true; return; }  // they started typing while we asked
      const kept = unsent();
      panels.innerHTML = html;
      restore(kept);
    }
    panels.addEventListener("focusout", () => { if (panelsPending) setTimeout(refreshPanels, 0); });

    async function resync() {
      const response = await get(root.dataset.snapshot);
      if (!response) return;
      const snapshot = await response.json();
      if (!renderSnapshot(snapshot)) return;  // a newer one is on screen, its panels asked for
      if (snapshot.seq > last) last = snapshot.seq;
      // Log lines the missed events carried: the server's tail, plus any that arrived since.
      const since = [...log.children].filter((item) => Number(item.dataset.seq) > snapshot.seq);
      log.replaceChildren(...snapshot.logs.map(logItem), ...since);
      await refreshPanels();
    }

    function logItem(event) {
      const item = el("li", {}, el("span", {class: "muted", text: "#" + event.step}), " " + event.message);
      item.dataset.seq = String(event.seq);
      return item;
    }
    function appendLog(event) {
      log.append(logItem(event));
      while (log.children.length > 30) log.firstElementChild.remove();
    }

    const types = ["task.snapshot", "progress", "log", "artifact", "checkpoint", "steering.applied",
                   "steering.rejected", "input_required", "recovering", "dead_lettered", "terminal"];
    function onEvent(type, message) {
      const event = JSON.parse(message.data);
      if (event.seq <= last) return;  // a duplicate around (re)connection
      const gap = type !== "task.snapshot" && event.seq > last + 1;
      last = event.seq;
      if (gap) resync();  // missed something: the snapshot is the truth; this event still counts
      switch (type) {
        case "task.snapshot": renderSnapshot(event); refreshPanels(); break;
        case "progress":
          renderProgress(event.progress, event.phase, event.message);
          if (event.step !== undefined) field("steps").textContent = String(event.step);
          break;
        case "log": appendLog(event); break;
        case "artifact": break;
        default: if (!gap) resync();  // control state moved: status, version, inputs, timelines
      }
      if (type === "terminal") source.close();
    }

    const indicator = field("stream");
    const show = (text, on) => { indicator.textContent = text; indicator.className = on ? "stream on" : "stream"; };
    let source = null;
    let retryMs = 1000;
    function connect() {
      source = new EventSource(root.dataset.events);
      // "live" once the server has caught up from our seq and listens (django-eventstream's
      // stream-open comes after that first read), not merely when the response began.
      source.addEventListener("stream-open", () => { show("● live", true); retryMs = 1000; });
      source.onerror = () => {
        show("○ reconnecting", false);
        if (source.readyState !== EventSource.CLOSED) return;  // a dropped connection: the browser retries
        // The server answered with something that is not a stream, so the browser gave up for
        // good: a 401 when the session ended (or 404, 5xx). Ask why, then act.
        setTimeout(diagnose, retryMs);
        retryMs = Math.min(retryMs * 2, 30000);
      };
      for (const type of types) source.addEventListener(type, (message) => onEvent(type, message));
    }
    async function diagnose() {
      try {
        const response = await fetch(root.dataset.snapshot, {credentials: "same-origin"});
        if (response.status === 401 || response.status === 403) { signIn(); return; }
        if (response.status === 404) { show("○ task not available", false); return; }
      } catch (e) { /* offline: the new stream's own retries take it from here */ }
      connect();  // it starts with a fresh task.snapshot
    }
    connect();
    window.addEventListener("beforeunload", () => source.close());
  }

  // Started from the page itself: the Content-Security-Policy allows no inline script, so
  // no page calls these; each part starts where its element is.
  function start() {
    const list = document.getElementById("task-list");
    if (list) liveList(list);
    const task = document.getElementById("task");
    if (task) {
      // the bar's first width, from the server's render (an inline style would be refused)
      for (const fill of task.querySelectorAll(".fill[data-width]")) fill.style.width = fill.dataset.width + "%";
      liveTask(task, Number(task.dataset.seq));
    }
    for (const select of document.querySelectorAll("select[data-autosubmit]")) {
      select.addEventListener("change", () => select.form.submit());
    }
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();

  return {liveList, liveTask};
})();
