// console.go: the web console on the daemon's HTTP listener (operate.md §4), the read side.
//
// Pages are server-rendered with html/template (so every value is escaped in its context) from
// templates embedded in the binary; they work without JavaScript, and console.js only reloads
// the overview. Every query runs on the pool with consoleStatementTimeout, never on the
// coordinator's connection; the coordinator's figures come from the snapshot it publishes
// for /metrics. Responses carry a Content-Security-Policy that allows nothing from outside
// the daemon. Actions (console_action.go) go through the operator's SQL functions.

package main

import (
	"bytes"
	"context"
	"database/sql"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"pepsi-dispatch/internal/printable"

	"github.com/lib/pq"
)

// consoleStatementTimeout bounds every query a page runs: a slow page must never hold a
// pool connection that the dispatcher's writes need.
const consoleStatementTimeout = 3 * time.Second

// consolePageSize is the number of rows a search page shows.
const consolePageSize = 50

//go:embed console
var consoleFiles embed.FS

// consoleCSP forbids everything but the daemon's own styles, script and images; inline SVG
// charts are markup, not resources, and need nothing more.
const consoleCSP = "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self' data:; " +
	"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

// console serves the pages. Its fields are set once before serving and read-only after.
type console struct {
	pool    func() *sql.DB          // the dispatcher's pool; nil until it exists (page and action check)
	snap    func() *metricsSnapshot // the coordinator's latest snapshot (nil before the first)
	samples *sampler
	counts  countCache // the overview's row counts, shared by its viewers
	log     *slog.Logger
	version string
	tmpl    *template.Template
	auth    *consoleAuth // nil: read-only, no action shown, action endpoints answer 403
	refused refusedLogins

	groupBudget time.Duration // consoleGroupBudget; a test's shorter one
}

func newConsole(pool func() *sql.DB, snap func() *metricsSnapshot, auth *consoleAuth, log *slog.Logger, version string) (*console, error) {
	t, err := template.New("").Funcs(template.FuncMap{
		"chart": chartSVG,
		"age":   fmtAge,
		"json":  prettyJSON,
		// shown is every text the console did not write itself (stage names, errors, the
		// configuration's values, an action's result), as a text node: what would reorder
		// the page (U+202E) or not show at all (ESC, CR) is written as an escape, as
		// pepsi-queue does. Attributes, links and form values carry the exact text.
		"shown": printable.Lines,
		// searchURL is a search page's address (relative: see pageData.Root): its query is
		// built by url.Values.Encode, so it is marked safe for the href it fills, not escaped
		// a second time.
		"searchURL": func(root string, v url.Values) template.URL {
			return template.URL(root + "search?" + v.Encode())
		},
	}).ParseFS(consoleFiles, "console/*.html")
	if err != nil {
		return nil, fmt.Errorf("parse console templates: %w", err)
	}
	return &console{pool: pool, snap: snap, log: log, version: version, tmpl: t, auth: auth,
		samples: newSampler(snap, pool, log), groupBudget: consoleGroupBudget}, nil
}

// withConsoleHeaders gives every response of the listener the console's security headers,
// the mux's own 404 and 405 answers included.
func withConsoleHeaders(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Security-Policy", consoleCSP)
		w.Header().Set("X-Content-Type-Options", "nosniff")
		h.ServeHTTP(w, r)
	})
}

// routes adds the console's handlers to mux.
func (c *console) routes(mux *http.ServeMux) {
	mux.HandleFunc("GET /{$}", c.page(c.overview))
	mux.HandleFunc("GET /stages", c.page(c.stages))
	mux.HandleFunc("GET /search", c.page(c.search))
	mux.HandleFunc("GET /failures", c.page(c.failures))
	mux.HandleFunc("GET /message/{id}", c.page(c.message))
	mux.HandleFunc("GET /static/", c.static)
	mux.HandleFunc("POST /action", c.action)
	mux.HandleFunc("POST /login", c.login)
	mux.HandleFunc("POST /logout", c.logout)
}

// pageData is what every page template receives.
type pageData struct {
	Title   string
	Nav     string
	Version string
	CanAct  bool   // a credential is configured and this browser is logged in
	Auth    bool   // a credential is configured at all (the login form is shown)
	CSRF    string // the token every action form carries
	Flash   string // the result of the last action, from the query string
	Root    string // the console's root relative to this page: consoleRoot
	Body    any
}

// consoleRoot is the console's root relative to the page at path ("./" or "../"), which
// every link, form and script of a page starts with. Relative links keep the console whole
// behind a reverse proxy that serves it under a path of its own and takes that path off
// (nginx: location /pepsi/ { proxy_pass http://127.0.0.1:9187/; }): the daemon never sees
// the prefix, and with absolute links every click left it for the proxy's other pages.
func consoleRoot(path string) string {
	if depth := strings.Count(path, "/") - 1; depth > 0 {
		return strings.Repeat("../", depth)
	}
	return "./"
}

// seeOther redirects to a location relative to the request's own (as links are: consoleRoot;
// http.Redirect would make it absolute). Every POST endpoint is at the console's root.
func seeOther(w http.ResponseWriter, location string) {
	w.Header().Set("Location", location)
	w.WriteHeader(http.StatusSeeOther)
}

// pageFunc renders one page's body data, or an error with an HTTP status.
type pageFunc func(r *http.Request) (title, nav string, body any, err error)

// httpError is an error with the status a page answers with.
type httpError struct {
	code int
	msg  string
}

func (e *httpError) Error() string { return e.msg }

func (c *console) page(f pageFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		consoleHeaders(w)
		root := consoleRoot(r.URL.Path)
		if c.pool() == nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			c.render(w, "error", pageData{Title: "Not connected yet", Version: c.version, Root: root,
				Body: "this dispatcher has no database pool yet: it is a standby, or waits for a writable server (see /metrics)"})
			return
		}
		title, nav, body, err := f(r)
		if err != nil && r.Context().Err() != nil {
			// The viewer left (a tab closed, a reload, a proxy that gave up): nobody reads the
			// answer, and nothing failed here. These were warnings, a dozen at once for a
			// crowd that left (TestConsoleLoadLeavesLoopItsConnections).
			return
		}
		if err != nil && timedOut(err) {
			err = c.pageTimedOut(r, err, "")
		}
		if err != nil {
			code := http.StatusInternalServerError
			var he *httpError
			if errors.As(err, &he) {
				code = he.code
			} else {
				c.log.Warn("console: page failed", "path", r.URL.Path, "err", err)
			}
			w.WriteHeader(code)
			c.render(w, "error", pageData{Title: http.StatusText(code), Version: c.version, Root: root, Body: err.Error()})
			return
		}
		d := pageData{Title: title, Nav: nav, Version: c.version, Body: body, Root: root,
			Auth: c.auth != nil, Flash: r.URL.Query().Get("done")}
		if c.auth != nil {
			if session, ok := c.auth.session(r); ok {
				d.CanAct, d.CSRF = true, c.auth.csrfToken(session)
			}
		}
		c.render(w, nav, d)
	}
}

func (c *console) render(w http.ResponseWriter, name string, d pageData) {
	var b bytes.Buffer // rendered whole first, so a template error is not half a page
	if err := c.tmpl.ExecuteTemplate(&b, name+".html", d); err != nil {
		c.log.Error("console: template failed", "template", name, "err", err)
		http.Error(w, "template error", http.StatusInternalServerError)
		return
	}
	w.Write(b.Bytes()) // a client gone away is no error of ours
}

func consoleHeaders(w http.ResponseWriter) {
	h := w.Header()
	h.Set("Content-Security-Policy", consoleCSP)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Type", "text/html; charset=utf-8")
}

func (c *console) static(w http.ResponseWriter, r *http.Request) {
	name := strings.TrimPrefix(r.URL.Path, "/static/")
	if !slices.Contains([]string{"console.css", "console.js"}, name) {
		http.NotFound(w, r)
		return
	}
	b, err := consoleFiles.ReadFile("console/" + name)
	if err != nil {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Security-Policy", consoleCSP)
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Cache-Control", "max-age=300")
	if strings.HasSuffix(name, ".css") {
		w.Header().Set("Content-Type", "text/css; charset=utf-8")
	} else {
		w.Header().Set("Content-Type", "text/javascript; charset=utf-8")
	}
	w.Write(b) // a client gone away is no error of ours
}

// ---- overview ----

// stageView is one stage's line on the overview.
type stageView struct {
	Name     string
	Counts   map[string]int64
	Workers  int
	InFlight int
	Paused   bool
	Held     bool // launch cool-down
	// Stray: not a stage of the running configuration, so that nothing claims its messages
	// (strays.go); known only when this daemon is the dispatcher.
	Stray  bool
	Oldest time.Duration
	Chart  template.HTML
}

// consoleStatuses are the statuses the overview counts, in the order it shows them. Done rows
// are not counted (as in /metrics): the table of done rows is the one that grows, and no
// index serves a count of it. Running rows are the dispatcher's own count (console_counts.go).
var consoleStatuses = []string{"pending", "running", "paused", "waiting", "held", "failed", "cancelled"}

func (c *console) overview(r *http.Request) (string, string, any, error) {
	ctx, cancel := context.WithTimeout(r.Context(), consoleStatementTimeout)
	defer cancel()
	views := map[string]*stageView{}
	get := func(name string) *stageView {
		if v := views[name]; v != nil {
			return v
		}
		v := &stageView{Name: name, Counts: map[string]int64{}}
		views[name] = v
		return v
	}
	var heldWrites, heldGroups int       // the dispatcher's, waiting for rows another transaction holds
	var refusedWrites, refusedGroups int // writes and fan-in wakes the database refuses by itself
	snap := c.snap()
	if snap != nil {
		for _, st := range snap.stages {
			v := get(st.name)
			v.Workers, v.InFlight, v.Held, v.Paused = st.workers, st.inflight, st.held, st.paused
			if st.running > 0 {
				v.Counts["running"] = int64(st.running) // no index serves running rows: the dispatcher's own count
			}
		}
		heldWrites, heldGroups, refusedWrites, refusedGroups = snap.held, snap.faninHeld, snap.refused, snap.faninRefused
	}
	counts, counted, err := c.counts.get(ctx, c.pool())
	if err != nil {
		return "", "", nil, err
	}
	for _, n := range counts {
		v := get(n.stage)
		v.Counts[n.status] = n.n
		if n.status == "pending" {
			v.Oldest = n.oldest
		}
	}
	paused, err := pausedStages(ctx, c.pool())
	if err != nil {
		return "", "", nil, err
	}
	// The stages the dispatcher does not run are shown up to strayListMax, those with the most
	// rows; the others are counted in one line (strays.go says why).
	configured := map[string]bool{}
	if snap != nil {
		for _, st := range snap.stages {
			configured[st.name] = true
		}
	}
	unknown := map[string]int64{}
	for name, v := range views {
		if !configured[name] {
			for _, n := range v.Counts {
				unknown[name] += n
			}
		}
	}
	var others struct{ Stages, Rows int64 }
	_, rest := topStages(unknown, strayListMax)
	for _, name := range rest {
		others.Stages++
		others.Rows += unknown[name]
		delete(views, name)
	}
	var out []*stageView
	for name, v := range views {
		v.Paused = v.Paused || paused[name] // the running configuration, or an overlay row not yet reloaded
		v.Stray = snap != nil && !configured[name]
		v.Chart = chartSVG(c.samples.points(name))
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b *stageView) int { return strings.Compare(a.Name, b.Name) })
	return "Overview", "overview", struct {
		Stages        []*stageView
		Statuses      []string
		Every         time.Duration
		Counted       time.Duration // how old the counts are (console_counts.go)
		HeldWrites    int           // pepsi_held_writes
		HeldGroups    int           // pepsi_fanin_held_groups
		RefusedWrites int           // pepsi_refused_writes
		RefusedGroups int           // pepsi_fanin_refused_groups
		Others        struct{ Stages, Rows int64 }
	}{out, consoleStatuses, consoleSampleEvery, time.Since(counted), heldWrites, heldGroups, refusedWrites, refusedGroups, others}, nil
}

// pausedStages reads the PAUSED overlay rows (operate.md §3): a stage is paused when its
// [stage-NAME] section in the config table says PAUSED = yes.
func pausedStages(ctx context.Context, db *sql.DB) (map[string]bool, error) {
	rows, err := db.QueryContext(ctx, `
		SELECT substr(section, 7) FROM config
		 WHERE section LIKE 'stage-%' AND upper(key) = 'PAUSED' AND lower(value) IN ('yes', 'true', '1', 'on')`)
	if err != nil {
		return nil, fmt.Errorf("read paused stages: %w", err)
	}
	defer rows.Close()
	out := map[string]bool{}
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			return nil, fmt.Errorf("read paused stages: %w", err)
		}
		out[s] = true
	}
	return out, rows.Err()
}

// ---- stages' configuration ----

// overlayView is one row of the config table.
type overlayView struct{ Section, Key, Value string }

func (c *console) stages(r *http.Request) (string, string, any, error) {
	ctx, cancel := context.WithTimeout(r.Context(), consoleStatementTimeout)
	defer cancel()
	rows, err := c.pool().QueryContext(ctx, `SELECT section, key, value FROM config ORDER BY section, key`)
	if err != nil {
		return "", "", nil, fmt.Errorf("read the config table: %w", err)
	}
	defer rows.Close()
	var overlay []overlayView
	for rows.Next() {
		var o overlayView
		if err := rows.Scan(&o.Section, &o.Key, &o.Value); err != nil {
			return "", "", nil, fmt.Errorf("read the config table: %w", err)
		}
		overlay = append(overlay, o)
	}
	if err := rows.Err(); err != nil {
		return "", "", nil, fmt.Errorf("read the config table: %w", err)
	}
	paused, err := pausedStages(ctx, c.pool())
	if err != nil {
		return "", "", nil, err
	}
	var running []*StageConfig
	if s := c.snap(); s != nil {
		running = s.config
	}
	type stageRow struct {
		*StageConfig
		Paused bool
	}
	var out []stageRow
	for _, sc := range running {
		out = append(out, stageRow{sc, sc.Paused || paused[sc.Name]})
	}
	return "Stages", "stages", struct {
		Stages  []stageRow
		Overlay []overlayView
	}{out, overlay}, nil
}

// ---- search ----

// searchQuery is a parsed search form. The zero value lists the newest rows.
type searchQuery struct {
	ID       int64
	Stage    string
	Status   string
	Error    string
	JSONPath string // a jsonpath predicate on the payload, e.g. $.to == "a@example.org"
	Before   int64  // keyset: show rows with a smaller id (0: from the newest)
}

func parseSearch(v url.Values) (searchQuery, error) {
	var q searchQuery
	var err error
	if s := strings.TrimSpace(v.Get("id")); s != "" {
		if q.ID, err = strconv.ParseInt(s, 10, 64); err != nil || q.ID <= 0 {
			return q, &httpError{http.StatusBadRequest, fmt.Sprintf("id %q is not a message id", s)}
		}
	}
	if s := strings.TrimSpace(v.Get("before")); s != "" {
		if q.Before, err = strconv.ParseInt(s, 10, 64); err != nil || q.Before <= 0 {
			return q, &httpError{http.StatusBadRequest, fmt.Sprintf("before %q is not a message id", s)}
		}
	}
	q.Stage = strings.TrimSpace(v.Get("stage"))
	q.Status = strings.TrimSpace(v.Get("status"))
	if q.Status != "" && q.Status != "done" && !slices.Contains(consoleStatuses, q.Status) {
		return q, &httpError{http.StatusBadRequest, fmt.Sprintf("status %q is not a state", q.Status)}
	}
	q.Error = v.Get("error")
	q.JSONPath = strings.TrimSpace(v.Get("path"))
	for _, f := range []struct{ name, text string }{{"stage", q.Stage}, {"error", q.Error}, {"path", q.JSONPath}} {
		if err := checkText(f.name, f.text); err != nil {
			return q, err
		}
	}
	return q, nil
}

// checkText refuses what a query string can carry and a PostgreSQL text parameter cannot
// (invalid UTF-8, NUL): the statement would fail with a server error, which the page would
// show as its own failure (500) and log, where it is the operator's typing (400).
func checkText(name, s string) error {
	if !utf8.ValidString(s) || strings.IndexByte(s, 0) >= 0 {
		return &httpError{http.StatusBadRequest, fmt.Sprintf("%s %q is not valid text (UTF-8 without NUL)", name, s)}
	}
	return nil
}

// values is the query string of q without its keyset position.
func (q searchQuery) values() url.Values {
	v := url.Values{}
	set := func(k, s string) {
		if s != "" {
			v.Set(k, s)
		}
	}
	if q.ID > 0 {
		v.Set("id", strconv.FormatInt(q.ID, 10))
	}
	set("stage", q.Stage)
	set("status", q.Status)
	set("error", q.Error)
	set("path", q.JSONPath)
	return v
}

// messageRow is a message as a list shows it.
type messageRow struct {
	ID       int64
	Stage    string
	Status   string
	Attempts int
	Age      time.Duration
	Error    string
}

// searchSQL builds the search statement: every condition a parameter, newest first, keyset
// paged by id (WHERE workqueue_id < $before ORDER BY workqueue_id DESC LIMIT n walks the
// primary key backwards from the position, so page 500 costs what page 1 costs).
func searchSQL(q searchQuery) (string, []any) {
	var where []string
	var args []any
	add := func(cond string, v any) {
		args = append(args, v)
		where = append(where, fmt.Sprintf(cond, len(args)))
	}
	if q.ID > 0 {
		add("workqueue_id = $%d", q.ID)
	}
	if q.Before > 0 {
		add("workqueue_id < $%d", q.Before)
	}
	if q.Stage != "" {
		add("stage = $%d", q.Stage)
	}
	if q.Status != "" {
		add("status = $%d", q.Status)
	}
	if q.Error != "" {
		add("strpos(state->>'dispatch_error', $%d) > 0", q.Error)
	}
	if q.JSONPath != "" {
		add("payload @@ $%d::jsonpath", q.JSONPath)
	}
	s := `SELECT workqueue_id, stage, status, attempts,
	             extract(epoch FROM now() - created_at)::float8, coalesce(state->>'dispatch_error', '')
	        FROM workqueue`
	if len(where) > 0 {
		s += " WHERE " + strings.Join(where, " AND ")
	}
	s += fmt.Sprintf(" ORDER BY workqueue_id DESC LIMIT %d", consolePageSize+1)
	return s, args
}

// timedOut reports whether a query ended at its statement's deadline: the context's, or the
// server's cancel that the context sent (57014).
func timedOut(err error) bool {
	var pe *pq.Error
	return errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &pe) && pe.Code == "57014")
}

// pageTimedOut is the 503 of a page whose query ran past its time (timedOut), with what
// happened and, from a page that knows how to ask less, hint.
func (c *console) pageTimedOut(r *http.Request, err error, hint string) error {
	c.log.Warn("console: page timed out", "path", r.URL.Path, "err", err)
	msg := fmt.Sprintf("this page's query did not finish in time (%s, or the role's statement_timeout if "+
		"shorter): the table is large, or a transaction holds its rows (pg_stat_activity: idle in transaction)",
		consoleStatementTimeout)
	if hint != "" {
		msg += "; " + hint
	}
	return &httpError{http.StatusServiceUnavailable, msg}
}

// isPathError reports whether err, a search's, is its JSON path's: the path's grammar
// (syntax_error, 42601) or a data exception its own parts raise (class 22: a like_regex
// pattern that is no regular expression, 2201B; a datetime() template, 22007 ...). The
// search's other values are checked before the query, and none of them can raise those. Read
// by the SQLSTATE, not the text: a regular expression's error does not say "jsonpath", and a
// server's lc_messages may word the rest in another language (TestConsolePages).
func isPathError(err error) bool {
	var pe *pq.Error
	return errors.As(err, &pe) && (pe.Code == "42601" || pe.Code.Class() == "22")
}

func (c *console) search(r *http.Request) (string, string, any, error) {
	q, err := parseSearch(r.URL.Query())
	if err != nil {
		return "", "", nil, err
	}
	ctx, cancel := context.WithTimeout(r.Context(), consoleStatementTimeout)
	defer cancel()
	stmt, args := searchSQL(q)
	rows, err := c.pool().QueryContext(ctx, stmt, args...)
	if err != nil {
		if q.JSONPath != "" && isPathError(err) {
			return "", "", nil, &httpError{http.StatusBadRequest, "the JSON path is not valid: " + err.Error()}
		}
		if r.Context().Err() == nil && timedOut(err) {
			return "", "", nil, c.pageTimedOut(r, err,
				"narrow the search with a stage, a status or an id: an error text or a JSON path alone reads every row")
		}
		return "", "", nil, fmt.Errorf("search messages: %w", err)
	}
	defer rows.Close()
	var list []messageRow
	for rows.Next() {
		var m messageRow
		var age float64
		if err := rows.Scan(&m.ID, &m.Stage, &m.Status, &m.Attempts, &age, &m.Error); err != nil {
			return "", "", nil, fmt.Errorf("search messages: %w", err)
		}
		m.Age = time.Duration(age * float64(time.Second))
		m.Error = firstLine(m.Error, 160)
		list = append(list, m)
	}
	if err := rows.Err(); err != nil {
		return "", "", nil, fmt.Errorf("search messages: %w", err)
	}
	var next url.Values
	if len(list) > consolePageSize {
		list = list[:consolePageSize]
		next = q.values()
		next.Set("before", strconv.FormatInt(list[len(list)-1].ID, 10))
	}
	// Here is where an action on the selected rows comes back to: this search, this page.
	here := q.values()
	if q.Before > 0 {
		here.Set("before", strconv.FormatInt(q.Before, 10))
	}
	return "Search", "search", struct {
		Q        searchQuery
		Rows     []messageRow
		Next     url.Values
		Here     string
		Statuses []string
	}{q, list, next, "/search?" + here.Encode(), append([]string{"done"}, consoleStatuses...)}, nil
}

// ---- one message ----

// messageView is one row whole.
type messageView struct {
	ID                       int64
	Stage, Status            string
	Attempts                 int
	Payload, State           shownJSON
	Error                    string
	Created                  time.Time
	RetryAt, ClaimedAt       *time.Time
	FanoutID, WaitFanoutID   *int64
	Parent                   *int64 // the parent of a child's group
	ChildCounts              map[string]int64
	Expected, DoneN, FailedN int
	GroupState               string
	Actions                  []string
}

// consoleValueCap is how many characters of a payload or state the message page shows.
// PostgreSQL takes a jsonb value of up to 255 MB, and a queue may carry whole documents: the
// page read both values whole, and one look at a message of 80 MiB grew the dispatcher by
// 850 MiB (reading, indenting, escaping, rendering), enough for an appliance's kernel to kill
// it and stop the pipeline (TestConsoleMessageBigPayload).
const consoleValueCap = 64 << 10

// messagePageSQL reads one message for its page: the payload and the state indented by the
// server (jsonb_pretty: a value cut short is no longer JSON that Go could indent), their first
// $2 + 1 characters only, which tells a value cut from one of exactly $2. Each value is made
// text once (the subquery, OFFSET 0, is not pulled up into the outer expressions), which costs
// the server about a second for 80 MiB; its whole length would cost another pass.
const messagePageSQL = `
SELECT stage, status, attempts, pp, ps, left(coalesce(state->>'dispatch_error', ''), $2),
       created_at, retry_at, claimed_at, fanout_id, wait_fanout_id
  FROM (SELECT *, left(jsonb_pretty(payload), $2 + 1) AS pp, coalesce(left(jsonb_pretty(state), $2 + 1), '') AS ps
          FROM workqueue WHERE workqueue_id = $1 OFFSET 0) m`

// shownJSON is a payload or state as the message page shows it.
type shownJSON struct {
	Text  string // indented JSON (jsonb_pretty), whole or its first consoleValueCap characters
	Cut   bool   // it is longer than that
	Shown int    // consoleValueCap, when Cut
	Whole string // the command that prints it whole, when Cut
}

// cut notes a value of message id longer than consoleValueCap (messagePageSQL) and makes its
// text one to show.
func (v *shownJSON) cut(id int64) {
	if r := []rune(v.Text); len(r) > consoleValueCap {
		v.Text, v.Cut, v.Shown = string(r[:consoleValueCap]), true, consoleValueCap
		v.Whole = fmt.Sprintf("pepsi-queue show %d", id)
	}
	v.Text = printable.Lines(v.Text)
}

// consoleActions maps a state to the operator actions operate.md §1 allows from it.
var consoleActions = map[string][]string{
	"pending":   {"hold", "cancel"},
	"paused":    {"retry", "hold", "cancel"},
	"held":      {"release", "retry", "cancel"},
	"waiting":   {"cancel"},
	"running":   {"cancel"},
	"failed":    {"retry", "delete"},
	"cancelled": {"retry", "delete"},
	"done":      {"delete"},
}

func (c *console) message(r *http.Request) (string, string, any, error) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		return "", "", nil, &httpError{http.StatusBadRequest, "not a message id"}
	}
	ctx, cancel := context.WithTimeout(r.Context(), consoleStatementTimeout)
	defer cancel()
	m := messageView{ID: id}
	err = c.pool().QueryRowContext(ctx, messagePageSQL, id, consoleValueCap).
		Scan(&m.Stage, &m.Status, &m.Attempts, &m.Payload.Text, &m.State.Text, &m.Error,
			&m.Created, &m.RetryAt, &m.ClaimedAt, &m.FanoutID, &m.WaitFanoutID)
	if errors.Is(err, sql.ErrNoRows) {
		return "", "", nil, &httpError{http.StatusNotFound, fmt.Sprintf("message %d does not exist", id)}
	}
	if err != nil {
		return "", "", nil, fmt.Errorf("read message %d: %w", id, err)
	}
	m.Payload.cut(id)
	m.State.cut(id)
	m.Actions = consoleActions[m.Status]
	group := m.WaitFanoutID
	if m.FanoutID != nil {
		group = m.FanoutID
		var parent int64
		if err := c.pool().QueryRowContext(ctx, `SELECT parent_id FROM fanout WHERE fanout_id = $1`, *m.FanoutID).Scan(&parent); err == nil {
			m.Parent = &parent
		}
	}
	if group != nil {
		if err := c.pool().QueryRowContext(ctx, `SELECT expected_n, done_n, failed_n, state FROM fanout WHERE fanout_id = $1`, *group).
			Scan(&m.Expected, &m.DoneN, &m.FailedN, &m.GroupState); err != nil && !errors.Is(err, sql.ErrNoRows) {
			return "", "", nil, fmt.Errorf("read fan-out group %d: %w", *group, err)
		}
	}
	return fmt.Sprintf("Message %d", id), "message", m, nil
}

// ---- helpers ----

func prettyJSON(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	var out bytes.Buffer
	if json.Indent(&out, b, "", "  ") != nil {
		return printable.Lines(string(b))
	}
	return printable.Lines(out.String())
}

func fmtAge(d time.Duration) string {
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	default:
		return fmt.Sprintf("%dd", int(d.Hours()/24))
	}
}

// firstLine cuts s to its first line and at most n runes.
func firstLine(s string, n int) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i] + " …"
	}
	if r := []rune(s); len(r) > n {
		s = string(r[:n]) + "…"
	}
	return s
}
