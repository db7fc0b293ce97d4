// Cyclone console: the live parts and the select-all boxes. Hand-written, no library, nothing
// from another site (the Content-Security-Policy allows scripts from the console only).
"use strict";

// An element with data-refresh="URL" is replaced every data-every ms by the HTML fragment
// the console renders at URL (escaped on the server). Refreshing pauses while the tab is
// hidden, stops once the fragment says it is final (data-final), and backs off on errors.
function live(el) {
  const url = el.getAttribute("data-refresh");
  const every = Math.max(parseInt(el.getAttribute("data-every") || "2000", 10), 500);
  let delay = every;
  async function tick() {
    if (document.hidden) { setTimeout(tick, every); return; }
    try {
      const res = await fetch(url, { credentials: "same-origin", cache: "no-store",
                                     headers: { "Accept": "text/html" } });
      if (!res.ok) throw new Error(String(res.status));
      const html = await res.text();
      const doc = new DOMParser().parseFromString(html, "text/html");
      el.replaceChildren(...doc.body.childNodes);
      el.removeAttribute("data-stale");
      delay = every;
      if (el.querySelector("[data-final]")) return;
    } catch (err) {
      el.setAttribute("data-stale", "1");
      delay = Math.min(delay * 2, 30000);
    }
    setTimeout(tick, delay);
  }
  setTimeout(tick, every);
}

function selectAll(box) {
  const name = box.getAttribute("data-select-all");
  box.addEventListener("change", () => {
    for (const cb of box.form.querySelectorAll('input[type="checkbox"][name="' + name + '"]')) {
      cb.checked = box.checked;
    }
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-refresh]").forEach(live);
  document.querySelectorAll("[data-select-all]").forEach(selectAll);
});
