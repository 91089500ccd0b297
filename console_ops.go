// console_ops.go: the console's calls into the operator's SQL functions (operate.md §3): the
// failure groups and the actions. The console writes no workqueue row itself.
//
// TODO(console): wire to the functions of operate.sql once that lands (branch operate).

package main

import (
	"net/http"
	"time"
)

// failureGroup is one line of the failures page.
type failureGroup struct {
	Signature    string
	Count        int64
	Stages       []string
	First, Last  time.Time
	Example      int64
	ExampleError string
}

func (c *console) failures(r *http.Request) (string, string, any, error) {
	return "Failures", "failures", struct{ Groups []failureGroup }{}, nil
}

// runAction performs a checked action (console_action.go has done the checks).
func (c *console) runAction(w http.ResponseWriter, r *http.Request) {
	refuse(w, http.StatusNotImplemented, "actions are not wired yet")
}
