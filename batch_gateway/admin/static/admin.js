// backfill admin: live refresh of [data-refresh] blocks and confirmation of [data-confirm] forms.
(function () {
  "use strict";
  function refresh(el) {
    var url = el.getAttribute("data-refresh");
    fetch(url, {credentials: "same-origin", headers: {"accept": "text/html"}})
      .then(function (r) {
        if (r.status === 401) { window.location = "/admin/login?next=" + encodeURIComponent(location.pathname + location.search); return null; }
        return r.ok ? r.text() : null;
      })
      .then(function (html) {
        if (html !== null && html !== undefined) { el.innerHTML = html; el.removeAttribute("data-stale"); }
      })
      .catch(function () { el.setAttribute("data-stale", "true"); });
  }
  document.addEventListener("submit", function (event) {
    var message = event.target.getAttribute("data-confirm");
    if (message && !window.confirm(message)) { event.preventDefault(); }
  });
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh]").forEach(function (el) {
      var every = parseInt(el.getAttribute("data-interval") || "2000", 10);
      setInterval(function () { if (!document.hidden) { refresh(el); } }, every);
    });
  });
})();
