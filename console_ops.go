// console_ops.go: the console's calls into the operator's SQL functions (operate.sql,
// documented in pepsi-queue(1)): the failure groups and the actions. The console writes no
// workqueue row itself, so a click has exactly the semantics, guards and operator_log entry
// of the same pepsi-queue command.

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/lib/pq"
)

// consoleActor is the operator_log actor of every console action.
const consoleActor = "console"

// consoleBatch is how many rows one action statement changes at most when a whole group is
// acted on: each batch is its own short transaction (as pepsi-queue's), so the claim is never
// stalled behind a long one. An action on a group of more than consoleBatch rows asks first,
// as pepsi-queue asks above 1,000 without --yes.
const consoleBatch = 1000

// consoleGroupBudget is how long an action on a group goes on starting batches: a group of a
// million rows (an outage failed them all) takes longer than a request should, or than a
// proxy waits (nginx: 60 s). It stops between two batches, each committed, and says how far
// it got; acting again goes on. Its deadline, 10 × consoleStatementTimeout, cut it with a 500.
const consoleGroupBudget = 20 * time.Second

// groupConfirmation is the page that asks before an action on a large group: an action not
// taken, rendered by runAction instead of its redirect.
type groupConfirmation struct {
	Action, Signature, Back string
	Counted                 int64 // the count the failures page showed, 0 when none came
}

func (*groupConfirmation) Error() string { return "not confirmed" }

// failureGroup is one line of the failures page.
type failureGroup struct {
	Signature    string
	Count        int64
	Stages       []string
	First, Last  time.Time
	Example      int64
	ExampleError string
	Pattern      string
}

// consoleFailureGroups is how many signatures the failures page lists, the biggest first.
// Errors that name a tenant, a customer or a file in words, which no signature rule takes
// out, make a signature each: 20,000 of them made a page of 5.6 MB, three forms a row more
// with a credential (TestConsoleFailuresManySignatures). The page counts the rest.
const consoleFailureGroups = 100

func (c *console) failures(r *http.Request) (string, string, any, error) {
	ctx, cancel := context.WithTimeout(r.Context(), consoleStatementTimeout)
	defer cancel()
	// queue_errors orders the groups by size; the window counts them all before the LIMIT.
	rows, err := c.pool().QueryContext(ctx, `
		SELECT signature, count, stages, first_seen, last_seen, example_id, coalesce(left(example_error, 1000), ''),
		       coalesce(pattern, ''), count(*) OVER (), sum(count) OVER ()
		  FROM queue_errors('{}') LIMIT $1`, consoleFailureGroups)
	if err != nil {
		return "", "", nil, fmt.Errorf("group failures by signature: %w", err)
	}
	defer rows.Close()
	var page struct {
		Groups []failureGroup
		Others struct{ Signatures, Messages int64 } // past consoleFailureGroups
	}
	var all, messages, listed int64 // signatures and their messages in all, messages listed
	for rows.Next() {
		var g failureGroup
		if err := rows.Scan(&g.Signature, &g.Count, pq.Array(&g.Stages), &g.First, &g.Last,
			&g.Example, &g.ExampleError, &g.Pattern, &all, &messages); err != nil {
			return "", "", nil, fmt.Errorf("group failures by signature: %w", err)
		}
		g.ExampleError = firstLine(g.ExampleError, 200)
		page.Groups = append(page.Groups, g)
		listed += g.Count
	}
	if err := rows.Err(); err != nil {
		return "", "", nil, fmt.Errorf("group failures by signature: %w", err)
	}
	if all > int64(len(page.Groups)) {
		page.Others.Signatures, page.Others.Messages = all-int64(len(page.Groups)), messages-listed
	}
	return "Failures", "failures", page, nil
}

// consoleRowActions are the actions on messages, each one SQL function of operate.sql.
var consoleRowActions = map[string]string{
	"retry":   `SELECT ok, coalesce(reason, '') FROM queue_retry(p_ids => $1, p_actor => $2, p_filter => $3)`,
	"hold":    `SELECT ok, coalesce(reason, '') FROM queue_hold(p_ids => $1, p_actor => $2, p_filter => $3)`,
	"release": `SELECT ok, coalesce(reason, '') FROM queue_release(p_ids => $1, p_actor => $2, p_filter => $3)`,
	"cancel":  `SELECT ok, coalesce(reason, '') FROM queue_cancel(p_ids => $1, p_actor => $2, p_filter => $3)`,
	"delete":  `SELECT ok, coalesce(reason, '') FROM queue_delete(p_ids => $1, p_actor => $2, p_filter => $3)`,
}

// runAction performs a checked action (console_action.go has done the checks) and redirects
// back to the page it came from with a one-line summary.
func (c *console) runAction(w http.ResponseWriter, r *http.Request, session string) {
	action := r.PostFormValue("action")
	// Every field reaches PostgreSQL as text, or through json.Marshal (a signature), which
	// would turn invalid UTF-8 into U+FFFD and act on another filter than the one sent: one
	// check of the whole form here, not one per action.
	for name, vs := range r.PostForm {
		for _, v := range vs {
			if err := checkText(name, v); err != nil {
				refuse(w, http.StatusBadRequest, err.Error())
				return
			}
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*consoleStatementTimeout)
	defer cancel()
	var summary string
	var err error
	switch {
	case action == "pause" || action == "resume":
		summary, err = c.pause(ctx, r.PostFormValue("stage"), action == "pause")
	case consoleRowActions[action] != "":
		summary, err = c.actOnRows(ctx, action, r)
	default:
		refuse(w, http.StatusBadRequest, fmt.Sprintf("unknown action %q", action))
		return
	}
	var confirm *groupConfirmation
	if errors.As(err, &confirm) {
		consoleHeaders(w)
		c.render(w, "confirm", pageData{Title: "Confirm", Nav: "failures", Version: c.version, Root: consoleRoot(r.URL.Path),
			Auth: true, CanAct: true, CSRF: c.auth.csrfToken(session), Body: confirm})
		return
	}
	if err != nil {
		var he *httpError
		if ok := asHTTPError(err, &he); ok {
			refuse(w, he.code, he.msg)
			return
		}
		c.log.Error("console: action failed", "action", action, "err", err)
		refuse(w, http.StatusInternalServerError, "the action failed: "+err.Error())
		return
	}
	c.counts.invalidate() // the next overview counts the rows again
	c.log.Info("console: operator action", "action", action, "result", summary, "remote", r.RemoteAddr)
	back := r.PostFormValue("back")
	u, err := url.Parse(back)
	if err != nil || !strings.HasPrefix(back, "/") || strings.HasPrefix(back, "//") {
		u = &url.URL{Path: "/"} // a back that does not parse ("/%zz") panicked here
	}
	q := u.Query()
	q.Set("done", summary)
	u.RawQuery = q.Encode()
	seeOther(w, "."+u.String()) // back is the page's path from the console's root
}

func asHTTPError(err error, he **httpError) bool {
	e, ok := err.(*httpError)
	if ok {
		*he = e
	}
	return ok
}

// actOnRows runs a row action on the selected ids, or on every row of a failure group.
func (c *console) actOnRows(ctx context.Context, action string, r *http.Request) (string, error) {
	if sig := r.PostFormValue("signature"); sig != "" {
		filter, _ := json.Marshal(map[string]string{"signature": sig})
		if r.PostFormValue("confirm") != "yes" {
			var more bool
			if err := c.pool().QueryRowContext(ctx, `SELECT count(*) > $2 FROM queue_select($1::jsonb, 0, $2 + 1)`,
				string(filter), consoleBatch).Scan(&more); err != nil {
				return "", fmt.Errorf("count the rows of %s: %w", filter, err)
			}
			if more {
				counted, _ := strconv.ParseInt(r.PostFormValue("count"), 10, 64)
				return "", &groupConfirmation{Action: action, Signature: sig, Back: r.PostFormValue("back"), Counted: counted}
			}
		}
		return c.actOnFilter(ctx, action, string(filter))
	}
	var ids []int64
	for _, s := range r.PostForm["id"] {
		id, err := strconv.ParseInt(s, 10, 64)
		if err != nil || id <= 0 {
			return "", &httpError{http.StatusBadRequest, fmt.Sprintf("%q is not a message id", s)}
		}
		ids = append(ids, id)
	}
	if len(ids) == 0 {
		return "", &httpError{http.StatusBadRequest, "no message selected"}
	}
	ok, refused, why, err := c.act(ctx, action, ids, "")
	if err != nil {
		return "", err
	}
	return actionSummary(action, ok, refused, why), nil
}

// actOnFilter acts on every row a filter selects, consoleBatch ids per statement, until
// c.groupBudget is spent.
func (c *console) actOnFilter(ctx context.Context, action, filter string) (string, error) {
	var ok, refused int
	var why string
	after := int64(0)
	start := time.Now()
	for batches := 0; ; batches++ {
		var ids []int64
		rows, err := c.pool().QueryContext(ctx, `SELECT queue_select($1::jsonb, $2, $3)`, filter, after, consoleBatch)
		if err != nil {
			return "", fmt.Errorf("select the rows of %s: %w", filter, err)
		}
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				rows.Close()
				return "", fmt.Errorf("select the rows of %s: %w", filter, err)
			}
			ids = append(ids, id)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return "", fmt.Errorf("select the rows of %s: %w", filter, err)
		}
		if len(ids) == 0 {
			break
		}
		if batches > 0 && time.Since(start) > c.groupBudget {
			return actionSummary(action, ok, refused, why) +
				fmt.Sprintf("; stopped after %s with more left: act again to go on", time.Since(start).Round(time.Second)), nil
		}
		n, m, w, err := c.act(ctx, action, ids, filter)
		if err != nil {
			return "", err
		}
		ok, refused = ok+n, refused+m
		if why == "" {
			why = w
		}
		after = ids[len(ids)-1]
	}
	return actionSummary(action, ok, refused, why), nil
}

// act calls the action's SQL function once, in its own transaction.
func (c *console) act(ctx context.Context, action string, ids []int64, filter string) (ok, refused int, why string, err error) {
	var f sql.NullString
	if filter != "" {
		f = sql.NullString{String: filter, Valid: true}
	}
	rows, err := c.pool().QueryContext(ctx, consoleRowActions[action], pq.Array(ids), consoleActor, f)
	if err != nil {
		return 0, 0, "", fmt.Errorf("%s %d messages: %w", action, len(ids), err)
	}
	defer rows.Close()
	for rows.Next() {
		var good bool
		var reason string
		if err := rows.Scan(&good, &reason); err != nil {
			return 0, 0, "", fmt.Errorf("%s %d messages: %w", action, len(ids), err)
		}
		if good {
			ok++
		} else {
			refused++
			if why == "" {
				why = reason
			}
		}
	}
	return ok, refused, why, rows.Err()
}

func actionSummary(action string, ok, refused int, why string) string {
	s := fmt.Sprintf("%s: %d changed", action, ok)
	if refused > 0 {
		s += fmt.Sprintf(", %d refused (%s)", refused, why)
	}
	return s
}

// pause pauses or resumes a stage through queue_pause / queue_resume.
func (c *console) pause(ctx context.Context, stage string, on bool) (string, error) {
	if stage == "" {
		return "", &httpError{http.StatusBadRequest, "no stage named"}
	}
	var ok bool
	var reason sql.NullString
	err := c.pool().QueryRowContext(ctx, `SELECT ok, reason FROM queue_pause($1, $2, $3)`, stage, on, consoleActor).Scan(&ok, &reason)
	if err != nil {
		return "", fmt.Errorf("pause stage %s: %w", stage, err)
	}
	if !ok {
		return "", &httpError{http.StatusBadRequest, fmt.Sprintf("stage %s: %s", stage, reason.String)}
	}
	if on {
		return "stage " + stage + " paused", nil
	}
	return "stage " + stage + " resumed", nil
}
