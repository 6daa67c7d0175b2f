// gpubroker panel: confirm actions, and refresh the live part of a page.
"use strict";
(function () {
  function confirmForms(root) {
    root.querySelectorAll("form.confirm").forEach(function (form) {
      form.addEventListener("submit", function (event) {
        if (!window.confirm(form.dataset.confirm || "Are you sure?")) event.preventDefault();
      });
    });
  }
  function busy() {
    // never replace what the admin is typing into
    var el = document.activeElement;
    return el && (el.tagName === "INPUT" || el.tagName === "SELECT" || el.tagName === "TEXTAREA");
  }
  function refresh(live, seconds) {
    var token = document.querySelector("meta[name=xsrf-token]").content;
    var url = new URL(window.location.href);
    url.searchParams.delete("done");
    window.setTimeout(function tick() {
      if (busy()) { window.setTimeout(tick, seconds * 1000); return; }
      fetch(url, { headers: { "X-XSRFToken": token }, credentials: "same-origin", redirect: "manual" })
        .then(function (r) {
          if (r.type === "opaqueredirect" || r.status === 401 || r.status === 403) {
            // the login is gone (a broker restart, a hub logout): load the page
            // again, through the hub's login, once
            window.location.reload();
            return Promise.reject(r.status);
          }
          return r.ok ? r.text() : Promise.reject(r.status);
        })
        .then(function (html) {
          var doc = new DOMParser().parseFromString(html, "text/html");
          var fresh = doc.getElementById("live");
          if (fresh) {
            live.innerHTML = fresh.innerHTML;
            live.dataset.updated = new Date().toISOString();
            confirmForms(live);
          }
        })
        .catch(function () {})
        .finally(function () { window.setTimeout(tick, seconds * 1000); });
    }, seconds * 1000);
  }
  document.addEventListener("DOMContentLoaded", function () {
    confirmForms(document);
    var live = document.getElementById("live");
    if (live && live.dataset.refresh) refresh(live, parseFloat(live.dataset.refresh));
  });
})();
