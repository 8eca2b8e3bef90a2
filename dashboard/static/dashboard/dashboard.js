// The dashboard's only script: a live task list (polled) and a live task page (SSE).
// Client contract of the stream: docs/streaming.md (snapshot first, seq de-duplication,
// re-read the snapshot on a gap).
"use strict";
window.Dashboard = (() => {
  const percent = (p) => Math.round((p || 0) * 100);

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
    async function refresh() {
      try {
        const response = await fetch(table.dataset.source, {credentials: "same-origin"});
        if (response.ok) render((await response.json()).tasks);
      } catch (e) { /* offline for a moment: the next poll tries again */ }
      setTimeout(refresh, 2000);
    }
    setTimeout(refresh, 2000);
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

    function renderSnapshot(s) {
      renderProgress(s.progress, s.phase, s.statusMessage);
      const status = field("status");
      status.textContent = s.runtimeStatus;
      status.className = "badge " + s.runtimeStatus;
      field("version").textContent = String(s.stateVersion);
      field("steps").textContent = String(s.stepsDone);
      field("recoveries").textContent = String(s.recoveries);
      field("priority").textContent = String(s.priority);
    }

    // The panels (controls with their expectedVersion, inputs, timelines) are server-rendered;
    // re-read them when control state changes, but never under someone's typing.
    let panelsPending = false;
    async function refreshPanels() {
      const active = document.activeElement;
      if (active && panels.contains(active) && ["INPUT", "SELECT", "TEXTAREA"].includes(active.tagName)) {
        panelsPending = true;
        return;
      }
      panelsPending = false;
      const response = await fetch(root.dataset.panels, {credentials: "same-origin"});
      if (response.ok) panels.innerHTML = await response.text();
    }
    panels.addEventListener("focusout", () => { if (panelsPending) setTimeout(refreshPanels, 0); });

    async function resync() {
      const response = await fetch(root.dataset.snapshot, {credentials: "same-origin"});
      if (!response.ok) return;
      const snapshot = await response.json();
      if (snapshot.seq > last) last = snapshot.seq;
      renderSnapshot(snapshot);
      await refreshPanels();
    }

    function appendLog(event) {
      const item = el("li", {}, el("span", {class: "muted", text: "#" + event.step}), " " + event.message);
      log.append(item);
      while (log.children.length > 30) log.firstElementChild.remove();
    }

    const stream = field("stream");
    const source = new EventSource(root.dataset.events);
    source.onopen = () => { stream.textContent = "● live"; stream.className = "stream on"; };
    source.onerror = () => { stream.textContent = "○ reconnecting"; stream.className = "stream"; };
    const types = ["task.snapshot", "progress", "log", "artifact", "checkpoint", "steering.applied",
                   "steering.rejected", "input_required", "recovering", "dead_lettered", "terminal"];
    for (const type of types) {
      source.addEventListener(type, (message) => {
        const event = JSON.parse(message.data);
        if (event.seq <= last) return;  // a duplicate around (re)connection
        const gap = type !== "task.snapshot" && event.seq > last + 1;
        last = event.seq;
        if (gap) { resync(); return; }  // missed something: the snapshot is the truth
        switch (type) {
          case "task.snapshot": renderSnapshot(event); refreshPanels(); break;
          case "progress":
            renderProgress(event.progress, event.phase, event.message);
            if (event.step !== undefined) field("steps").textContent = String(event.step);
            break;
          case "log": appendLog(event); break;
          case "artifact": break;
          default: resync();  // control state moved: status, version, inputs, timelines
        }
        if (type === "terminal") source.close();
      });
    }
    window.addEventListener("beforeunload", () => source.close());
  }

  return {liveList, liveTask};
})();
