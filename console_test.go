// console_test.go: the web console's handlers against a real PostgreSQL: every page, escaping
// of hostile payloads, keyset paging, and the refusals of the write side (no credential,
// not logged in, a stale CSRF token, another origin).

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"html"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"
)

// consoleHarness is a console served by httptest over a test schema.
type consoleHarness struct {
	s   *testSchema
	c   *console
	srv *httptest.Server
}

const testConsoleToken = "test-console-credential-0123456789"

func newConsoleHarness(t *testing.T, token string) *consoleHarness {
	t.Helper()
	s := newTestSchema(t)
	var auth *consoleAuth
	if token != "" {
		auth = &consoleAuth{secret: []byte(token)}
	}
	snap := &metricsSnapshot{
		stages: []stageSnapshot{{name: "deliver"}, {name: "parse", workers: 2, inflight: 3}},
		held:   1, faninHeld: 2,
		config: []*StageConfig{{Name: "parse", Program: "/bin/<b>parse</b>", Parallelism: 2, QueueLimit: 4, MaxAttempts: 5}},
	}
	c, err := newConsole(func() *sql.DB { return s.DB }, func() *metricsSnapshot { return snap }, auth, slog.New(slog.NewTextHandler(io.Discard, nil)), "test")
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	c.routes(mux)
	srv := httptest.NewServer(withConsoleHeaders(mux))
	t.Cleanup(srv.Close)
	return &consoleHarness{s: s, c: c, srv: srv}
}

// consoleOverview fetches the overview of the console a running dispatcher serves at addr.
func consoleOverview(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/")
	if err != nil {
		t.Fatalf("GET the console's overview: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET the console's overview: %s, %v", resp.Status, err)
	}
	return string(b)
}

// get fetches path and returns the status and body.
func (h *consoleHarness) get(t *testing.T, cl *http.Client, path string) (int, string) {
	t.Helper()
	if cl == nil {
		cl = h.srv.Client()
	}
	resp, err := cl.Get(h.srv.URL + path)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: read body: %v", path, err)
	}
	if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") {
		t.Errorf("GET %s: Content-Security-Policy %q does not forbid external resources", path, csp)
	}
	return resp.StatusCode, string(b)
}

// post sends a form with the given Origin ("" sends none) and returns the status and body.
func (h *consoleHarness) post(t *testing.T, cl *http.Client, path, origin string, form url.Values) (int, string) {
	t.Helper()
	req, err := http.NewRequest("POST", h.srv.URL+path, strings.NewReader(form.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if origin != "" {
		req.Header.Set("Origin", origin)
	}
	resp, err := cl.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// login logs cl in through the login form and returns the CSRF token of its session.
func (h *consoleHarness) login(t *testing.T, cl *http.Client) string {
	t.Helper()
	if code, _ := h.post(t, cl, "/login", h.srv.URL, url.Values{"token": {testConsoleToken}}); code != 200 {
		t.Fatalf("login: %d, want 200 after the redirect", code)
	}
	return h.csrf(t, cl)
}

// csrf returns the CSRF token of cl's session, from the search page's forms.
func (h *consoleHarness) csrf(t *testing.T, cl *http.Client) string {
	t.Helper()
	_, body := h.get(t, cl, "/search")
	m := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`).FindStringSubmatch(body)
	if m == nil || !strings.Contains(body, `action="./action"`) {
		t.Fatal("logged in, the search page shows no action form with a CSRF token")
	}
	return m[1]
}

// holdTable locks workqueue in a transaction of its own until the test ends or the
// transaction it returns is rolled back: every page's query waits for it.
func (h *consoleHarness) holdTable(t *testing.T) *sql.Tx {
	t.Helper()
	tx, err := h.s.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback() })
	if _, err := tx.Exec(`LOCK TABLE workqueue IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	return tx
}

const hostilePayload = `{"text": "<script>alert('x')</script>", "html": "\"><img src=x onerror=alert(1)>"}`

func TestConsolePages(t *testing.T) {
	h := newConsoleHarness(t, "")
	h.s.exec(t, `INSERT INTO workqueue (stage, payload) VALUES ('parse', $1)`, hostilePayload)
	h.s.exec(t, `INSERT INTO workqueue (stage, status, attempts, payload, state)
	             VALUES ('deliver', 'failed', 5, '{}', '{"dispatch_error": "stage deliver: <b>relay</b> 10.0.0.1:25 down"}')`)
	h.s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-deliver', 'PAUSED', 'yes')`)
	h.s.exec(t, `INSERT INTO workqueue (stage, payload) VALUES ('delivre', '{}')`) // no such stage

	for _, tc := range []struct {
		path string
		code int
		want []string
	}{
		{"/", 200, []string{`id="stage-parse"`, `id="stage-deliver"`, `class="stage paused" id="stage-deliver"`,
			`href="./search?stage=deliver&amp;status=failed">1<`, "workers <b>2</b>", "in flight <b>3</b>", "<svg class=\"chart\"",
			"<b>1</b> failure or reset write (their messages stay running); <b>2</b> fan-in groups (their parents stay waiting)",
			`<h2>delivre <span class="badge warn">not configured</span></h2>`}},
		{"/stages", 200, []string{"&lt;b&gt;parse&lt;/b&gt;", "<td>PAUSED</td>"}},
		{"/search", 200, []string{`href="./message/1"`, `href="./message/2"`, "&lt;b&gt;relay&lt;/b&gt;"}},
		{"/search?status=failed", 200, []string{`href="./message/2"`}},
		{"/search?error=relay", 200, []string{`href="./message/2"`}},
		{"/search?path=" + url.QueryEscape(`$.text like_regex "script"`), 200, []string{`href="./message/1"`}},
		{"/search?path=" + url.QueryEscape(`$.(`), 400, []string{"JSON path is not valid"}},
		// A path's parts that PostgreSQL refuses as data, not as the path's grammar: their
		// errors do not say "jsonpath" (a 500 before). The SQLSTATE, not the server's words,
		// which follow its lc_messages.
		{"/search?path=" + url.QueryEscape(`$.text like_regex "("`), 400, []string{"JSON path is not valid", "(2201B)"}},
		{"/search?path=" + url.QueryEscape(`$.text.datetime("xx") == "x"`), 400, []string{"JSON path is not valid", "(22007)"}},
		{"/search?status=bogus", 400, []string{"is not a state"}},
		{"/search?id=x", 400, []string{"not a message id"}},
		// Text PostgreSQL cannot hold is the operator's mistake (400), not a failed page (500).
		{"/search?status=&stage=%ff", 400, []string{"stage", "not valid text"}},
		{"/search?error=a%00b", 400, []string{"error", "not valid text"}},
		{"/search?path=%C3", 400, []string{"path", "not valid text"}},
		{"/message/1", 200, []string{"&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;", "&lt;img src=x onerror=alert(1)&gt;"}},
		{"/message/999", 404, []string{"does not exist"}},
		{"/message/abc", 400, nil},
		{"/failures", 200, nil},
		{"/static/console.css", 200, []string{".chart"}},
		{"/static/../console.go", 404, nil},
	} {
		code, body := h.get(t, nil, tc.path)
		if n := strings.Count(body, "not configured</span>"); tc.path == "/" && n != 1 {
			t.Errorf("GET /: %d stages marked not configured, want 1 (delivre)", n)
		}
		if code != tc.code {
			t.Errorf("GET %s: status %d, want %d\n%s", tc.path, code, tc.code, body)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(body, w) {
				t.Errorf("GET %s: body lacks %q", tc.path, w)
			}
		}
		if tc.path == "/message/1" {
			// In UTC, as on the failures page and in pepsi-queue show: the session's
			// TimeZone is the server's, and its offset was printed as the zone (+1345).
			var created time.Time
			if err := h.s.DB.QueryRow(`SELECT created_at FROM workqueue WHERE workqueue_id = 1`).Scan(&created); err != nil {
				t.Fatal(err)
			}
			if w := "<dd>" + created.UTC().Format("2006-01-02 15:04:05Z") + "</dd>"; !strings.Contains(body, w) {
				t.Errorf("GET /message/1: body lacks the message's creation time in UTC, %s", w)
			}
		}
		if tc.path == "/failures" {
			// In UTC, as pepsi-queue errors prints them: the session's TimeZone is the
			// server's (a DBA's Pacific/Chatham in make test-server-settings), and a time
			// without its zone could not be told from UTC.
			var first time.Time
			if err := h.s.DB.QueryRow(`SELECT first_seen FROM queue_errors()`).Scan(&first); err != nil {
				t.Fatal(err)
			}
			if w := first.UTC().Format("2006-01-02 15:04Z"); !strings.Contains(body, w) {
				t.Errorf("GET /failures: body lacks the first failure's time in UTC, %s", w)
			}
		}
		// Nothing of the hostile payload survives unescaped, on any page.
		for _, bad := range []string{"<script>alert", "<img src=x", "<b>relay", "<b>parse"} {
			if strings.Contains(body, bad) {
				t.Errorf("GET %s: body contains unescaped %q", tc.path, bad)
			}
		}
		if strings.HasPrefix(tc.path, "/search?stage") && !strings.Contains(body, "selected") {
			t.Errorf("GET %s: the form does not keep the query", tc.path)
		}
	}
	// Without a credential no action is shown anywhere.
	for _, p := range []string{"/", "/search", "/message/1", "/stages", "/failures"} {
		if _, body := h.get(t, nil, p); regexp.MustCompile(`action="[./]*action"`).MatchString(body) {
			t.Errorf("GET %s: an action form is shown without a credential", p)
		}
	}
}

// pathProxy is a reverse proxy serving the console at target under /pepsi/, taking the prefix
// off as nginx's location /pepsi/ { proxy_pass http://127.0.0.1:9187/; } does, and passing
// the browser's host on in X-Forwarded-Host. Everything else on it answers 418.
func pathProxy(t *testing.T, target string) *httptest.Server {
	t.Helper()
	to, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/pepsi/", &httputil.ReverseProxy{Rewrite: func(r *httputil.ProxyRequest) {
		r.SetURL(to)
		r.Out.URL.Path = strings.TrimPrefix(r.In.URL.Path, "/pepsi")
		r.Out.URL.RawPath = ""
		r.SetXForwarded()
	}})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "not the console", http.StatusTeapot)
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

// TestConsoleBehindPathProxy: behind a reverse proxy that serves the console under a path of
// its own (nginx's location /pepsi/ { proxy_pass http://127.0.0.1:9187/; }, which takes the
// prefix off), every link, form and redirect of every page stays under that path, and the
// login cookie is scoped to it. The console does not know the prefix: its links are relative.
func TestConsoleBehindPathProxy(t *testing.T) {
	h := newConsoleHarness(t, testConsoleToken)
	h.s.exec(t, `INSERT INTO workqueue (stage, payload) VALUES ('parse', '{}')`)
	h.s.exec(t, `INSERT INTO workqueue (stage, status, attempts, payload, state)
	             VALUES ('deliver', 'failed', 5, '{}', '{"dispatch_error": "relay down"}')`)
	// A page more than the search shows, so that its "older" link is followed too.
	h.s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'parse', '{}' FROM generate_series(1, $1)`, consolePageSize)
	proxy := pathProxy(t, h.srv.URL)
	root := proxy.URL + "/pepsi/"
	jar, _ := cookiejar.New(nil)
	cl := &http.Client{Jar: jar}

	fetch := func(method, u string, form url.Values) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest(method, u, strings.NewReader(form.Encode()))
		if err != nil {
			t.Fatal(err)
		}
		if method == "POST" {
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Header.Set("Origin", proxy.URL)
		}
		resp, err := cl.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, u, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	attr := regexp.MustCompile(`(href|src|action)="([^"]*)"`)
	// under resolves every link, source and form action of a page against the page's address
	// and fails those that leave the console's path; it returns the GET ones and the forms'.
	under := func(page *url.URL, body string) (gets, forms []string) {
		t.Helper()
		for _, m := range attr.FindAllStringSubmatch(body, -1) {
			ref, err := url.Parse(html.UnescapeString(m[2]))
			if err != nil {
				t.Errorf("%s: %s=%q is not a URL: %v", page, m[1], m[2], err)
				continue
			}
			u := page.ResolveReference(ref).String()
			if !strings.HasPrefix(u, root) {
				t.Errorf("%s: %s=%q leads to %s, outside %s", page, m[1], m[2], u, root)
				continue
			}
			if m[1] == "action" {
				forms = append(forms, u)
			} else {
				gets = append(gets, u)
			}
		}
		return gets, forms
	}

	// Log in through the proxy: the redirect lands on the console's overview under the
	// prefix, and the cookie goes to the console's path only.
	resp, body := fetch("GET", root, nil)
	_, forms := under(resp.Request.URL, body)
	if len(forms) != 1 || !strings.HasSuffix(forms[0], "/pepsi/login") {
		t.Fatalf("the overview's forms before logging in: %v, want the login form under /pepsi/", forms)
	}
	resp, _ = fetch("POST", forms[0], url.Values{"token": {testConsoleToken}})
	if resp.StatusCode != 200 || resp.Request.URL.String() != root {
		t.Fatalf("login through the proxy: %s at %s, want 200 at %s", resp.Status, resp.Request.URL, root)
	}
	other, _ := url.Parse(proxy.URL + "/another-app/")
	if ck := jar.Cookies(other); len(ck) != 0 {
		t.Errorf("the login cookie is sent to another application on the proxy's host: %v", ck)
	}

	// Every page reachable from the overview, logged in (so with every form shown).
	seen := map[string]bool{root: false}
	queue := []string{root}
	kinds := map[string]bool{}
	for len(queue) > 0 && len(seen) < 300 {
		u := queue[0]
		queue = queue[1:]
		resp, body := fetch("GET", u, nil)
		if resp.StatusCode != 200 {
			t.Errorf("GET %s (linked from the console): %s", u, resp.Status)
			continue
		}
		path := strings.TrimPrefix(resp.Request.URL.Path, "/pepsi")
		kind, _, _ := strings.Cut(strings.TrimPrefix(path, "/"), "/")
		kinds[kind] = true
		if !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
			continue
		}
		gets, _ := under(resp.Request.URL, body)
		for _, g := range gets {
			if _, ok := seen[g]; !ok {
				seen[g] = false
				queue = append(queue, g)
			}
		}
	}
	for _, k := range []string{"", "failures", "search", "stages", "message", "static"} {
		if !kinds[k] {
			t.Errorf("no page /%s reached through the links (reached: %v)", k, slices.Collect(maps.Keys(kinds)))
		}
	}

	// An action from a message's page comes back to that page under the prefix.
	resp, body = fetch("GET", root+"message/2", nil)
	_, forms = under(resp.Request.URL, body)
	m := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`).FindStringSubmatch(body)
	if m == nil || len(forms) != 2 { // log out, and the message's actions
		t.Fatalf("the failed message's page offers forms %v (csrf %v)", forms, m)
	}
	resp, body = fetch("POST", forms[1], url.Values{"action": {"retry"}, "id": {"2"}, "csrf": {m[1]}, "back": {"/message/2"}})
	if resp.StatusCode != 200 || resp.Request.URL.Path != "/pepsi/message/2" || !strings.Contains(body, `id="flash"`) {
		t.Errorf("retry through the proxy: %s at %s, want the message's page with the result", resp.Status, resp.Request.URL)
	}
	// Log out: back at the overview, the cookie gone.
	resp, _ = fetch("POST", forms[0], nil)
	if resp.StatusCode != 200 || resp.Request.URL.String() != root {
		t.Errorf("logout through the proxy: %s at %s, want 200 at %s", resp.Status, resp.Request.URL, root)
	}
	if ck := jar.Cookies(resp.Request.URL); len(ck) != 0 {
		t.Errorf("the login cookie is still held after logging out: %v", ck)
	}
}

// TestConsoleShowsControlCharacters: stage names, errors, payloads and the configuration's
// values are written by producers and stages; those holding Unicode's bidirectional overrides
// (which reorder what follows: "U+202E gnp.exe" reads "exe.png") or control characters (ESC,
// CR) are shown with those written as escapes on every page, as pepsi-queue shows them, while
// links carry the exact text.
func TestConsoleShowsControlCharacters(t *testing.T) {
	h := newConsoleHarness(t, "")
	const stage, reason = "ru\u202eexe.txt", "boom \x1b[2J\r\u2066gnp.exe\u2069"
	id := h.s.count(t, `INSERT INTO workqueue (stage, status, attempts, payload, state)
		VALUES ($1, 'failed', 1, jsonb_build_object('name', 'a' || chr(8238) || 'b'), jsonb_build_object('dispatch_error', $2::text))
		RETURNING workqueue_id`, stage, reason)
	// The config table's check refuses such a stage name now; a row written before it (an
	// older schema) is still shown.
	h.s.exec(t, `ALTER TABLE config DISABLE TRIGGER config_check`)
	h.s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-ru' || chr(8238) || 'x', 'PROGRAM', '/bin/' || chr(8238) || 'fdp')`)
	h.s.exec(t, `ALTER TABLE config ENABLE TRIGGER config_check`)
	tags := regexp.MustCompile(`<[^>]*>`)
	for _, tc := range []struct {
		path string
		want []string // in the page's text, escaped
	}{
		{"/", []string{`ru\u202eexe.txt`}},
		{"/search", []string{`ru\u202eexe.txt`, `boom \x1b[2J\x0d\u2066gnp.exe\u2069`}},
		{"/failures", []string{`ru\u202eexe.txt`}},
		{"/message/" + strconv.Itoa(id), []string{`ru\u202eexe.txt`, `boom \x1b[2J\x0d\u2066gnp.exe\u2069`, `a\u202eb`}},
		{"/stages", []string{`stage-ru\u202ex`, `/bin/\u202efdp`}},
	} {
		code, body := h.get(t, nil, tc.path)
		if code != 200 {
			t.Fatalf("GET %s: status %d\n%s", tc.path, code, body)
		}
		text := tags.ReplaceAllString(body, " ")
		for _, r := range text {
			if r != '\n' && r != '\t' && (unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r)) {
				t.Errorf("GET %s: the page's text holds %U", tc.path, r)
			}
		}
		for _, w := range tc.want {
			if !strings.Contains(text, w) {
				t.Errorf("GET %s: the page's text lacks %q", tc.path, w)
			}
		}
	}
	if _, body := h.get(t, nil, "/"); !strings.Contains(body, `href="./search?stage=ru%e2%80%aeexe.txt&amp;status=failed"`) {
		t.Errorf("the overview's link to the stage's failed rows does not carry its exact name")
	}
}

// TestConsoleKeysetPaging pages through 130 rows newest first: every row exactly once, 50 a
// page, and the next page's position is the last id shown (no OFFSET anywhere).
func TestConsoleKeysetPaging(t *testing.T) {
	h := newConsoleHarness(t, "")
	h.s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'parse', '{}' FROM generate_series(1, 130)`)
	if stmt, _ := searchSQL(searchQuery{Before: 10}); strings.Contains(strings.ToUpper(stmt), "OFFSET") {
		t.Fatalf("search statement pages by OFFSET: %s", stmt)
	}
	ids := regexp.MustCompile(`href="./message/(\d+)"`)
	next := regexp.MustCompile(`id="next" href="./search\?([^"]*)"`)
	seen := map[string]bool{}
	path, pages := "/search?stage=parse", 0
	for path != "" {
		pages++
		code, body := h.get(t, nil, path)
		if code != 200 {
			t.Fatalf("GET %s: %d", path, code)
		}
		m := ids.FindAllStringSubmatch(body, -1)
		if pages < 3 && len(m) != consolePageSize {
			t.Fatalf("page %d has %d rows, want %d", pages, len(m), consolePageSize)
		}
		for _, id := range m {
			if seen[id[1]] {
				t.Fatalf("row %s shown twice", id[1])
			}
			seen[id[1]] = true
		}
		path = ""
		if n := next.FindStringSubmatch(body); n != nil {
			path = "/search?" + strings.ReplaceAll(n[1], "&amp;", "&")
			if !strings.Contains(path, "stage=parse") {
				t.Fatalf("the next page's link loses the filter: %s", path)
			}
		}
	}
	if pages != 3 || len(seen) != 130 {
		t.Fatalf("%d pages, %d rows; want 3 pages, 130 rows", pages, len(seen))
	}
}

// TestConsoleWriteRefusals: every way an action is refused changes nothing.
func TestConsoleWriteRefusals(t *testing.T) {
	t.Run("no credential", func(t *testing.T) {
		h := newConsoleHarness(t, "")
		for _, p := range []string{"/action", "/login"} {
			if code, _ := h.post(t, h.srv.Client(), p, h.srv.URL, url.Values{"action": {"retry"}, "id": {"1"}}); code != 403 {
				t.Errorf("POST %s without a credential: %d, want 403", p, code)
			}
		}
		if code, _ := h.get(t, nil, "/action"); code != 405 {
			t.Errorf("GET /action: %d, want 405 (actions are POST only)", code)
		}
	})
	t.Run("with credential", func(t *testing.T) {
		h := newConsoleHarness(t, testConsoleToken)
		jar, _ := cookiejar.New(nil)
		cl := &http.Client{Jar: jar}
		if code, _ := h.post(t, cl, "/login", h.srv.URL, url.Values{"token": {"wrong-credential-xxxxxxxxxx"}}); code != 403 {
			t.Fatalf("login with a wrong credential: %d, want 403", code)
		}
		if code, _ := h.post(t, cl, "/action", h.srv.URL, url.Values{"action": {"retry"}, "id": {"1"}}); code != 403 {
			t.Fatalf("action before logging in: %d, want 403", code)
		}
		if code, _ := h.post(t, cl, "/login", "http://evil.example", url.Values{"token": {testConsoleToken}}); code != 403 {
			t.Fatalf("login from another origin: %d, want 403", code)
		}
		csrf := h.login(t, cl)
		for _, tc := range []struct {
			name, origin, csrf string
		}{
			{"no CSRF token", h.srv.URL, ""},
			{"stale CSRF token", h.srv.URL, strings.Repeat("0", len(csrf))},
			{"other origin", "http://evil.example", csrf},
			{"no origin", "", csrf},
		} {
			code, _ := h.post(t, cl, "/action", tc.origin, url.Values{"action": {"retry"}, "id": {"1"}, "csrf": {tc.csrf}})
			if code != 403 {
				t.Errorf("%s: %d, want 403", tc.name, code)
			}
		}
		// Logged in, with the token: a mistake in the form is a 400 that names it.
		for _, tc := range []struct {
			form url.Values
			want string
		}{
			{url.Values{"action": {"pause"}, "stage": {"\xff"}}, "not valid text"},
			{url.Values{"action": {"pause"}, "stage": {"a\x00b"}}, "not valid text"},
			{url.Values{"action": {"retry"}, "signature": {"\xff"}}, "not valid text"}, // json.Marshal would make it U+FFFD
			{url.Values{"action": {"pause"}}, "no stage named"},
			{url.Values{"action": {"explode"}}, "unknown action"},
			{url.Values{"action": {"retry"}, "id": {"x"}}, "not a message id"},
		} {
			tc.form.Set("csrf", csrf)
			if code, body := h.post(t, cl, "/action", h.srv.URL, tc.form); code != 400 || !strings.Contains(body, tc.want) {
				t.Errorf("POST /action %v: %d %q, want 400 naming %q", tc.form, code, body, tc.want)
			}
		}
		// A back field that is no path of the console's, or no URL at all, leads to the
		// overview (one that did not parse panicked the handler after the action had run).
		for _, back := range []string{"/%zz", "//evil.example/", "http://evil.example/", ""} {
			code, body := h.post(t, cl, "/action", h.srv.URL, url.Values{"action": {"pause"}, "stage": {"parse"}, "csrf": {csrf}, "back": {back}})
			if code != 200 || !strings.Contains(body, `id="stage-parse"`) || !strings.Contains(body, `id="flash"`) {
				t.Errorf("POST /action with back %q: %d, want the overview with the action's result", back, code)
			}
		}
	})
}

// TestConsoleGroupActionConfirmed: an action on a failure group of more than 1,000 messages
// asks first, as pepsi-queue does without --yes (one click acted on the whole group, whatever
// its size), and a group too large to finish within the request's budget stops between two
// batches and says how far it got, where its deadline cut it with a 500.
func TestConsoleGroupActionConfirmed(t *testing.T) {
	h := newConsoleHarness(t, testConsoleToken)
	h.s.exec(t, `INSERT INTO workqueue (stage, status, attempts, payload, state)
	             SELECT 'deliver', 'failed', 5, '{}', '{"dispatch_error": "relay down"}' FROM generate_series(1, 2500)`)
	h.s.exec(t, `INSERT INTO workqueue (stage, status, attempts, payload, state)
	             SELECT 'parse', 'failed', 5, '{}', '{"dispatch_error": "bad input"}' FROM generate_series(1, 10)`)
	jar, _ := cookiejar.New(nil)
	cl := &http.Client{Jar: jar}
	csrf := h.login(t, cl)
	var big, small string
	if err := h.s.DB.QueryRow(`SELECT max(signature) FILTER (WHERE count = 2500), max(signature) FILTER (WHERE count = 10)
	                             FROM queue_errors('{}')`).Scan(&big, &small); err != nil {
		t.Fatal(err)
	}
	failed := func(stage string) int {
		return h.s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'failed' AND stage = $1`, stage)
	}
	// The failures page's forms carry the count it showed.
	if _, body := h.get(t, cl, "/failures"); !strings.Contains(body, `name="count" value="2500"`) {
		t.Errorf("the failures page's form for the group of 2,500 does not carry its count")
	}

	// Not confirmed: a page that asks, nothing changed.
	code, body := h.post(t, cl, "/action", h.srv.URL, url.Values{"action": {"delete"}, "signature": {big},
		"count": {"2500"}, "back": {"/failures"}, "csrf": {csrf}})
	if code != 200 || !strings.Contains(body, "more than 1,000 messages") || !strings.Contains(body, "2500 when the failures page counted them") ||
		!strings.Contains(body, `name="confirm" value="yes"`) {
		t.Fatalf("delete all of 2,500 without confirming: %d, want a page asking first\n%s", code, body)
	}
	if n := failed("deliver"); n != 2500 {
		t.Fatalf("%d of 2,500 left after an action not confirmed", n)
	}
	// The page's own form, submitted (its action and fields as the browser sends them).
	form := url.Values{}
	for _, m := range regexp.MustCompile(`<input type="hidden" name="([a-z]+)" value="([^"]*)">`).FindAllStringSubmatch(body, -1) {
		form.Set(m[1], html.UnescapeString(m[2]))
	}
	if form.Get("action") != "delete" || form.Get("signature") != big || form.Get("csrf") != csrf {
		t.Fatalf("the confirmation's form carries %v", form)
	}
	form.Set("action", "retry") // retry, not delete, so that the rows stay countable
	// A budget spent after the first batch: it stops there and says so.
	h.c.groupBudget = time.Nanosecond
	code, body = h.post(t, cl, "/action", h.srv.URL, form)
	if code != 200 || !strings.Contains(body, "retry: 1000 changed") || !strings.Contains(body, "more left: act again to go on") {
		t.Errorf("a confirmed retry past its budget: %d, want the first batch's result and what is left\n%s", code, body)
	}
	if n := failed("deliver"); n != 1500 {
		t.Errorf("%d of 2,500 left failed after one batch, want 1,500", n)
	}
	h.c.groupBudget = consoleGroupBudget
	if code, body = h.post(t, cl, "/action", h.srv.URL, form); code != 200 || !strings.Contains(body, "retry: 1500 changed") ||
		strings.Contains(body, "more left") {
		t.Errorf("the confirmed retry again: %d, want the other 1,500\n%s", code, body)
	}
	if n := failed("deliver"); n != 0 {
		t.Errorf("%d left failed after both", n)
	}
	// A group of 1,000 or fewer acts at once.
	if code, body = h.post(t, cl, "/action", h.srv.URL, url.Values{"action": {"retry"}, "signature": {small},
		"back": {"/failures"}, "csrf": {csrf}}); code != 200 || !strings.Contains(body, "retry: 10 changed") {
		t.Errorf("retry all of 10: %d, want it done at once\n%s", code, body)
	}
}

// TestConsolePageTimeout: a page whose query does not finish within consoleStatementTimeout
// (a search for an error text over millions of rows; here a transaction holding the table)
// answers 503 with what happened and what to do, not a 500 with the driver's words.
func TestConsolePageTimeout(t *testing.T) {
	h := newConsoleHarness(t, "")
	h.s.exec(t, `INSERT INTO workqueue (stage, status, state) VALUES ('a', 'failed', '{"dispatch_error": "x"}')`)
	h.holdTable(t)
	for _, path := range []string{"/search?error=relay", "/failures", "/message/1"} {
		code, body := h.get(t, nil, path)
		if code != http.StatusServiceUnavailable || !strings.Contains(body, "did not finish in time (3s") {
			t.Errorf("GET %s with the table held: %d, want 503 saying the query took too long\n%s", path, code, body)
		}
	}
	if code, body := h.get(t, nil, "/search?error=relay"); !strings.Contains(body, "narrow the search") {
		t.Errorf("GET /search timed out: %d, no advice to narrow it\n%s", code, body)
	}
}

// TestConsoleSearchActionKeepsSearch: an action on rows selected in a search comes back to
// that search, its filters and page kept, where it went back to an empty search form.
func TestConsoleSearchActionKeepsSearch(t *testing.T) {
	h := newConsoleHarness(t, testConsoleToken)
	h.s.exec(t, `INSERT INTO workqueue (stage, status, state) SELECT 'deliver', 'failed', '{"dispatch_error": "relay down"}' FROM generate_series(1, 3)`)
	jar, _ := cookiejar.New(nil)
	cl := &http.Client{Jar: jar}
	csrf := h.login(t, cl)
	search := "/search?error=relay&stage=deliver&status=failed"
	_, body := h.get(t, cl, search)
	m := regexp.MustCompile(`<input type="hidden" name="back" value="([^"]*)">`).FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("the search's rows form has no back field:\n%s", body)
	}
	back := html.UnescapeString(m[1])
	req, _ := http.NewRequest("POST", h.srv.URL+"/action", strings.NewReader(url.Values{"action": {"retry"}, "id": {"1", "2"},
		"csrf": {csrf}, "back": {back}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", h.srv.URL)
	resp, err := cl.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	got := resp.Request.URL.Query()
	if resp.Request.URL.Path != "/search" || got.Get("error") != "relay" || got.Get("stage") != "deliver" ||
		got.Get("status") != "failed" || got.Get("done") != "retry: 2 changed" {
		t.Errorf("after an action from %s: at %s, want the same search with the action's result", search, resp.Request.URL)
	}
}

// TestConsoleOriginRefusalSays: a refused Origin says what was compared: behind a proxy that
// passes the host without its port (nginx's $host, where the proxy listens on 8443), every
// action was refused with "cross-origin request refused" and nothing to go on.
func TestConsoleOriginRefusalSays(t *testing.T) {
	h := newConsoleHarness(t, testConsoleToken)
	req, _ := http.NewRequest("POST", h.srv.URL+"/login", strings.NewReader(url.Values{"token": {testConsoleToken}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", "https://mgmt.example:8443")
	req.Header.Set("X-Forwarded-Host", "mgmt.example")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 403 || !strings.Contains(string(b), `the request's origin is https://mgmt.example:8443, this console's host mgmt.example`) ||
		!strings.Contains(string(b), "$http_host") {
		t.Errorf("a login whose origin has a port the forwarded host lacks: %d %q, want 403 naming both and the proxy's setting", resp.StatusCode, b)
	}
}

// TestConsoleTwoSystemsOneHost: the consoles of two systems on one host (two listeners, or
// two SSH tunnels to 127.0.0.1:9187 and :9188) keep their logins apart: a browser's cookies
// are the host's whatever the port, and both consoles named theirs alike, so logging in to
// one logged out of the other.
func TestConsoleTwoSystemsOneHost(t *testing.T) {
	a := newConsoleHarness(t, testConsoleToken)
	b := newConsoleHarness(t, "another-console-credential-987654")
	jar, _ := cookiejar.New(nil) // one browser
	cl := &http.Client{Jar: jar}
	a.login(t, cl)
	if code, _ := b.post(t, cl, "/login", b.srv.URL, url.Values{"token": {"another-console-credential-987654"}}); code != 200 {
		t.Fatalf("login to the second console: %d", code)
	}
	for name, h := range map[string]*consoleHarness{"first": a, "second": b} {
		if _, body := h.get(t, cl, "/search"); !strings.Contains(body, `name="csrf"`) {
			t.Errorf("after logging in to both, the %s console is not logged in", name)
		}
	}
}

// TestConsoleSessionExpires: the login cookie is stateless (logging out can only take it out
// of the browser), so it carries its issue time under the credential's HMAC and expires: a
// copy of it, or of a page's CSRF token, does not act for ever. A session's CSRF token is
// its own.
func TestConsoleSessionExpires(t *testing.T) {
	h := newConsoleHarness(t, testConsoleToken)
	h.s.exec(t, `INSERT INTO workqueue (stage, payload) VALUES ('parse', '{}')`)
	pause := func(cl *http.Client, csrf string) int {
		code, _ := h.post(t, cl, "/action", h.srv.URL, url.Values{"action": {"pause"}, "stage": {"parse"}, "csrf": {csrf}})
		return code
	}
	jar, _ := cookiejar.New(nil)
	cl := &http.Client{Jar: jar}
	csrf := h.login(t, cl)
	if code := pause(cl, csrf); code != 200 {
		t.Fatalf("an action in a fresh session: %d, want 200", code)
	}
	u, _ := url.Parse(h.srv.URL)
	cookie := cl.Jar.Cookies(u)[0]
	if cookie.Value == h.c.auth.mac("pepsi-console session") {
		t.Errorf("the login cookie is the credential's one fixed value: it never expires")
	}

	// The same cookie, its issue time moved back past the lifetime (the HMAC made again, as
	// only the daemon can): refused, and its pages offer no action.
	old := time.Now().Add(-consoleSessionLifetime - time.Minute)
	for _, value := range []string{h.c.auth.sessionValue(old), h.c.auth.mac("pepsi-console session"), "x.y", ""} {
		jar, _ := cookiejar.New(nil)
		jar.SetCookies(u, []*http.Cookie{{Name: h.c.auth.cookieName(), Value: value}})
		stale := &http.Client{Jar: jar}
		if code := pause(stale, csrf); code != 403 {
			t.Errorf("an action with the cookie %q: %d, want 403", value, code)
		}
		if _, body := h.get(t, stale, "/search"); strings.Contains(body, `name="csrf"`) {
			t.Errorf("with the cookie %q, the search page offers actions", value)
		}
	}
	// A cookie whose time was changed without the HMAC: refused.
	_, mac, _ := strings.Cut(h.c.auth.sessionValue(old), ".")
	jar, _ = cookiejar.New(nil)
	jar.SetCookies(u, []*http.Cookie{{Name: h.c.auth.cookieName(), Value: strconv.FormatInt(time.Now().Unix(), 10) + "." + mac}})
	if code := pause(&http.Client{Jar: jar}, csrf); code != 403 {
		t.Errorf("an action with a cookie whose time was changed: %d, want 403", code)
	}
	// Another session (issued an hour ago, still valid): the first's CSRF token does not act
	// in it, its own does.
	jar, _ = cookiejar.New(nil)
	jar.SetCookies(u, []*http.Cookie{{Name: h.c.auth.cookieName(), Value: h.c.auth.sessionValue(time.Now().Add(-time.Hour))}})
	cl2 := &http.Client{Jar: jar}
	csrf2 := h.csrf(t, cl2)
	if code := pause(cl2, csrf); code != 403 {
		t.Errorf("an action with another session's CSRF token: %d, want 403", code)
	}
	if code := pause(cl2, csrf2); code != 200 {
		t.Errorf("an action in the second session: %d, want 200", code)
	}
	if ma := cookieMaxAge(t, h); ma <= 0 || ma > int(consoleSessionLifetime.Seconds()) {
		t.Errorf("the login cookie's Max-Age is %d, want the session's lifetime at most", ma)
	}
}

// cookieMaxAge logs in once more and returns the Max-Age of the cookie the login sets.
func cookieMaxAge(t *testing.T, h *consoleHarness) int {
	t.Helper()
	req, _ := http.NewRequest("POST", h.srv.URL+"/login", strings.NewReader(url.Values{"token": {testConsoleToken}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", h.srv.URL)
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	for _, c := range resp.Cookies() {
		if c.Name == h.c.auth.cookieName() {
			return c.MaxAge
		}
	}
	t.Fatal("the login set no cookie")
	return 0
}

// TestConsoleTokenFile: each mistake in CONSOLE_TOKEN_FILE is a configuration error at the
// key's line (exit 2), and the credential is never part of a message.
func TestConsoleTokenFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, tc := range []struct {
		name, path, want string
	}{
		{"missing", filepath.Join(dir, "nope"), "read the console credential"},
		{"world-readable", write("open", testConsoleToken, 0o644), "readable by everyone"},
		{"short", write("short", "tooshort", 0o600), "at least 16 characters"},
		{"two lines", write("two", testConsoleToken+"\nsecond-line-here", 0o600), "one line"},
	} {
		cfg := &Config{Dispatch: DispatchConfig{ConsoleTokenFile: tc.path, consoleTokenAt: "pepsi.conf:7"}}
		err := cfg.loadConsoleToken()
		var ce *configError
		if !errors.As(err, &ce) || ce.Where != "pepsi.conf:7" || ce.Key != "CONSOLE_TOKEN_FILE" || !strings.Contains(ce.Msg, tc.want) {
			t.Errorf("%s: got %v, want a configError at pepsi.conf:7 about %q", tc.name, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), testConsoleToken) {
			t.Errorf("%s: the error shows the credential: %v", tc.name, err)
		}
	}
	for name, content := range map[string]string{
		"good": testConsoleToken + "\n",
		// Saved by Windows' Notepad: a byte order mark and CRLF, which the operator does not
		// type at the login form.
		"notepad": "\uFEFF" + testConsoleToken + "\r\n",
	} {
		cfg := &Config{Dispatch: DispatchConfig{ConsoleTokenFile: write(name, content, 0o600)}}
		if err := cfg.loadConsoleToken(); err != nil || cfg.consoleToken != testConsoleToken {
			t.Fatalf("the file %s: %v, token %q", name, err, cfg.consoleToken)
		}
	}
	if _, err := loadConfig(write("pepsi.conf", "[database]\nDSN = dbname=x\n[pepsi-dispatch]\nCONSOLE_TOKEN_FILE = relative/path\n", 0o644)); err == nil ||
		!strings.Contains(err.Error(), "absolute path") {
		t.Fatalf("a relative CONSOLE_TOKEN_FILE: %v, want a refusal", err)
	}
}

// TestConsoleCountsShared: the overview's count is one for all viewers of a moment
// (console_counts.go). Loads at the same time share one count, a load within
// consoleCountEvery shows the same figures though rows changed, a later load counts again, and
// an action on the console makes the next load count at once.
func TestConsoleCountsShared(t *testing.T) {
	h := newConsoleHarness(t, testConsoleToken)
	h.s.exec(t, `INSERT INTO workqueue (stage) SELECT 'parse' FROM generate_series(1, 3)`)
	pendingRe := regexp.MustCompile(`status-pending"><a href="./search\?stage=parse&amp;status=pending">(\d+)<`)
	jar, _ := cookiejar.New(nil)
	cl := &http.Client{Jar: jar}
	pending := func() string {
		t.Helper()
		code, body := h.get(t, cl, "/")
		m := pendingRe.FindStringSubmatch(body)
		if code != 200 || m == nil {
			t.Fatalf("overview: %d, no pending count for parse:\n%s", code, body)
		}
		return m[1]
	}

	var wg sync.WaitGroup
	ats := make([]time.Time, 8)
	for i := range ats {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, at, err := h.c.counts.get(context.Background(), h.s.DB)
			if err != nil {
				t.Error(err)
			}
			ats[i] = at
		}()
	}
	wg.Wait()
	for _, at := range ats[1:] {
		if !at.Equal(ats[0]) {
			t.Fatalf("8 loads at once made more than one count: %v", ats)
		}
	}

	h.s.exec(t, `INSERT INTO workqueue (stage) SELECT 'parse' FROM generate_series(1, 2)`)
	got := pending()
	if time.Since(ats[0]) < consoleCountEvery && got != "3" {
		t.Errorf("a load within %v of the count shows %s pending, want the count's 3", consoleCountEvery, got)
	}
	waitFor(t, 10*time.Second, "the overview counting the 2 new rows", func() bool { return pending() == "5" })

	csrf := h.login(t, cl)
	var id int64
	if err := h.s.DB.QueryRow(`SELECT min(workqueue_id) FROM workqueue`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	pending() // a fresh count, so that only the action can make the next load count again
	before := time.Now()
	if code, body := h.post(t, cl, "/action", h.srv.URL, url.Values{"action": {"hold"}, "id": {fmt.Sprint(id)},
		"csrf": {csrf}, "back": {"/"}}); code != 200 {
		t.Fatalf("hold: %d\n%s", code, body)
	}
	if got := pending(); got != "4" {
		t.Errorf("the load after the hold shows %s pending, want 4", got)
	}
	if el := time.Since(before); el >= consoleCountEvery {
		t.Logf("the action and the load took %v: the cache would have expired anyway", el)
	}
}

// TestConsoleCountDuty: a count waits consoleCountEvery, or consoleCountDuty times its own
// duration when that is longer, up to consoleCountMaxAge.
func TestConsoleCountDuty(t *testing.T) {
	for _, tc := range []struct{ took, want time.Duration }{
		{time.Millisecond, consoleCountEvery},
		{80 * time.Millisecond, 4 * time.Second},
		{2 * time.Second, consoleCountMaxAge},
	} {
		cc := countCache{took: tc.took}
		if got := cc.every(); got != tc.want {
			t.Errorf("a count of %v is good for %v, want %v", tc.took, got, tc.want)
		}
	}
}

// TestConsoleCountFailureKept: a count that ran into the statement timeout is not made again
// at the next load (it cost as much as one that finished), and an action counts again.
func TestConsoleCountFailureKept(t *testing.T) {
	h := newConsoleHarness(t, "")
	h.s.exec(t, `INSERT INTO workqueue (stage) VALUES ('parse')`)
	tx := h.holdTable(t) // the count waits for this lock until the page's statement timeout
	if code, _ := h.get(t, nil, "/"); code == 200 {
		t.Fatal("the overview loaded while its count could not read the table")
	}
	start := time.Now()
	if code, _ := h.get(t, nil, "/"); code == 200 {
		t.Fatal("the second load succeeded while the table was still locked")
	}
	if el := time.Since(start); el >= consoleStatementTimeout/2 {
		t.Errorf("the load after a timed-out count took %v: it counted again instead of keeping the failure", el)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	h.c.counts.invalidate() // as an action does (TestConsoleCountsShared goes through one)
	if code, body := h.get(t, nil, "/"); code != 200 || !strings.Contains(body, `id="stage-parse"`) {
		t.Errorf("after the lock and an action: %d\n%s", code, body)
	}
}

// TestConsoleCountViewerLeft: a count whose viewer went away (its request's context
// cancelled) is not kept as a failure: the next viewer counts.
func TestConsoleCountViewerLeft(t *testing.T) {
	h := newConsoleHarness(t, "")
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the viewer has gone: the count's first statement fails at once
	if _, _, err := h.c.counts.get(ctx, h.s.DB); err == nil {
		t.Fatal("a count under a cancelled context succeeded")
	}
	if _, _, err := h.c.counts.get(context.Background(), h.s.DB); err != nil {
		t.Errorf("the count after a viewer left: %v, want a count", err)
	}
}

// FuzzConsoleSearch: whatever query string the search page is given, parseSearch either
// refuses it with a 400 or returns a query whose text PostgreSQL can hold and whose own
// links (values, with the keyset position) parse back to the same query, so the next page
// searches for what this one did.
func FuzzConsoleSearch(f *testing.F) {
	for _, s := range []string{"", "stage=parse&status=failed", "id=12&before=40", "error=relay+down",
		"path=%24.to+%3D%3D+%22a%40example.org%22", "stage=%20parse%20&error=%20x%20", "stage=%ff",
		"error=a%00b", "status=done", "status=bogus", "id=-1", "before=0", "id=%2B7", "stage=a&stage=b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		v, err := url.ParseQuery(raw)
		if err != nil {
			return // net/http gives the page what it could parse; that is a url.Values too
		}
		q, err := parseSearch(v)
		if err != nil {
			var he *httpError
			if !errors.As(err, &he) || he.code != http.StatusBadRequest || he.msg == "" {
				t.Fatalf("parseSearch(%q): %v, want a 400 with a message", raw, err)
			}
			return
		}
		for _, s := range []string{q.Stage, q.Status, q.Error, q.JSONPath} {
			if !utf8.ValidString(s) || strings.IndexByte(s, 0) >= 0 {
				t.Fatalf("parseSearch(%q) = %+v: text PostgreSQL cannot hold", raw, q)
			}
		}
		back := q.values()
		if q.Before > 0 {
			back.Set("before", strconv.FormatInt(q.Before, 10))
		}
		q2, err := parseSearch(back)
		if err != nil || q2 != q {
			t.Fatalf("parseSearch(%q) = %+v; its links %q parse to %+v, %v", raw, q, back.Encode(), q2, err)
		}
		if _, args := searchSQL(q); len(args) != len(back) {
			t.Fatalf("parseSearch(%q) = %+v: %d parameters for %d conditions", raw, q, len(args), len(back))
		}
	})
}

// TestSamplerPendingByIndex holds the console's backlog sample to the partial indexes of
// pending rows: it runs every consoleSampleEvery while the console is on, viewed or not, and a
// scan of the table there grows with every done row kept (it did: 360 ms every 10 s on a
// table of 4 million done rows). The count must include pending rows parked behind their
// concurrency key, which the other index holds.
func TestSamplerPendingByIndex(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `ALTER TABLE workqueue SET (autovacuum_enabled = false)`)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'a', 'done' FROM generate_series(1, 20000)`)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'a', 'pending' FROM generate_series(1, 30)`)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'a', 'running' FROM generate_series(1, 3)`)
	s.exec(t, `INSERT INTO workqueue (stage, status, concurrency_key, key_parked)
	           SELECT 'b', 'pending', 'k', true FROM generate_series(1, 5)`)
	s.exec(t, `INSERT INTO workqueue (stage, status, concurrency_key) VALUES ('b', 'pending', 'k')`)
	tx, seqScans := staleStatsTx(t, s)
	before := seqScans()
	got, err := pendingPerStage(context.Background(), tx)
	if err != nil {
		t.Fatal(err)
	}
	if n := seqScans() - before; n != 0 {
		t.Errorf("the backlog sample scanned workqueue %d times, want none (the partial indexes of pending rows)", n)
	}
	if want := map[string]int64{"a": 30, "b": 6}; !maps.Equal(got, want) {
		t.Errorf("pending per stage: got %v, want %v", got, want)
	}
}

// TestLiveRowsByIndex holds the row counts of /metrics (at every scrape) and of the console's
// overview to the partial indexes of the statuses they count: they were one scan of the whole
// table, done rows and all (0.4 s on 4 million, past /metrics' budget with a few tens of
// millions). Done and running rows are not counted there (running ones are the dispatcher's
// own count); every other status is, per stage, with the oldest pending row's age.
func TestLiveRowsByIndex(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `ALTER TABLE workqueue SET (autovacuum_enabled = false)`)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'a', 'done' FROM generate_series(1, 20000)`)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'a', 'running' FROM generate_series(1, 3)`)
	s.exec(t, `INSERT INTO workqueue (stage, status, created_at) SELECT 'a', 'pending', now() - interval '1 hour' FROM generate_series(1, 4)`)
	s.exec(t, `INSERT INTO workqueue (stage, status, concurrency_key, key_parked, created_at)
	           VALUES ('b', 'pending', 'k', true, now() - interval '2 hours'), ('b', 'pending', 'k', false, now())`)
	for _, st := range []string{"paused", "waiting", "held", "failed", "cancelled"} {
		s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'c', $1 FROM generate_series(1, 2)`, st)
	}
	s.exec(t, `INSERT INTO workqueue (stage, status) VALUES ('a', 'failed')`)
	tx, seqScans := staleStatsTx(t, s)
	before := seqScans()
	lines, err := countPerStage(context.Background(), tx)
	if err != nil {
		t.Fatal(err)
	}
	if n := seqScans() - before; n != 0 {
		t.Errorf("the row count scanned workqueue %d times, want none (the partial indexes of each status)", n)
	}
	got := map[string]int64{}
	oldest := map[string]time.Duration{}
	for _, l := range lines {
		got[l.stage+" "+l.status] = l.n
		if l.status == "pending" {
			oldest[l.stage] = l.oldest
		}
	}
	want := map[string]int64{"a pending": 4, "a failed": 1, "b pending": 2, "c paused": 2, "c waiting": 2,
		"c held": 2, "c failed": 2, "c cancelled": 2}
	if !maps.Equal(got, want) {
		t.Errorf("rows per stage and status: got %v, want %v", got, want)
	}
	if a, b := oldest["a"], oldest["b"]; a < 59*time.Minute || a > 70*time.Minute || b < 119*time.Minute || b > 130*time.Minute {
		t.Errorf("oldest pending: a %v (want about 1h), b %v (want about 2h, a parked row)", a, b)
	}
}
