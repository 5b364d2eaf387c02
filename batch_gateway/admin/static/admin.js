// backfill admin: live refresh of [data-refresh] blocks and confirmation of [data-confirm] forms.
// A block that could not be refreshed for longer than its interval is marked stale (data-stale)
// and a banner above it says its figures are unknown, with their age.
(function () {
  "use strict";
  function banner(el) {
    var note = el.previousElementSibling;
    if (note && note.classList.contains("stale")) { return note; }
    note = document.createElement(el.tagName === "TBODY" ? "caption" : "p");
    note.className = "stale";
    note.setAttribute("role", "alert");
    if (el.tagName === "TBODY") { el.parentNode.insertBefore(note, el.parentNode.firstChild); }
    else { el.parentNode.insertBefore(note, el); }
    return note;
  }
  function failed(el) {
    var age = Math.round((Date.now() - (+el.dataset.refreshedAt || Date.now())) / 1000);
    el.setAttribute("data-stale", "true");
    banner(el).textContent = "Not refreshed for " + age + " s: the figures here are unknown, not live.";
  }
  function refresh(el) {
    var url = el.getAttribute("data-refresh");
    fetch(url, {credentials: "same-origin", headers: {"accept": "text/html"}})
      .then(function (r) {
        if (r.status === 401) { window.location = "/admin/login?next=" + encodeURIComponent(location.pathname + location.search); return null; }
        if (!r.ok) { failed(el); return null; }
        return r.text();
      })
      .then(function (html) {
        if (html === null || html === undefined) { return; }
        el.innerHTML = html;
        el.dataset.refreshedAt = String(Date.now());
        el.removeAttribute("data-stale");
        var note = el.tagName === "TBODY" ? el.parentNode.querySelector("caption.stale") : el.previousElementSibling;
        if (note && note.classList.contains("stale")) { note.remove(); }
      })
      .catch(function () { failed(el); });
  }
  document.addEventListener("submit", function (event) {
    var message = event.target.getAttribute("data-confirm");
    if (message && !window.confirm(message)) { event.preventDefault(); }
  });
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh]").forEach(function (el) {
      var every = parseInt(el.getAttribute("data-interval") || "2000", 10);
      el.dataset.refreshedAt = String(Date.now());
      setInterval(function () { if (!document.hidden) { refresh(el); } }, every);
    });
  });
})();
