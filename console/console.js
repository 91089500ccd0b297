// The overview refreshes itself every 5 s while the tab is visible; an action's result is
// shown once. Nothing else: the console works the same without this script.
"use strict";
// The result of an action comes in the address (?done=...), for pages that work without
// JavaScript: taken out of it once shown, so that a reload (the overview's own, every 5 s,
// or the operator's) does not show the last action's result again.
(function () {
  var q = new URLSearchParams(location.search);
  if (q.has("done")) {
    q.delete("done");
    var rest = q.toString();
    history.replaceState(null, "", location.pathname + (rest ? "?" + rest : "") + location.hash);
  }
})();
if (document.body.dataset.page === "overview") {
  setInterval(function () {
    if (document.visibilityState === "visible") { location.reload(); }
  }, 5000);
}
