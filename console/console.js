// The overview refreshes itself every 5 s while the tab is visible; every other page is
// static. Nothing else: the console works the same without this script.
"use strict";
if (document.body.dataset.page === "overview") {
  setInterval(function () {
    if (document.visibilityState === "visible") { location.reload(); }
  }, 5000);
}
