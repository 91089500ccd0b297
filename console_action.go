// console_action.go: the console's write side: the credential, the login cookie, the CSRF
// token, the Origin check, and actions through the operator's SQL functions.
//
// Without a credential in pepsi.conf the console is read-only: no action is shown and every
// action endpoint answers 403. With one, an operator logs in once with it; the browser then
// holds a cookie derived from it (an HMAC of the login's time, so the credential itself never
// travels again; it expires after consoleSessionLifetime), and every action form carries a
// CSRF token derived from the cookie. Actions are POST only, and
// a request whose Origin (or, lacking it, Referer) is not this listener's own is refused. The
// credential is compared in constant time and is never logged.

package main

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// consoleCookie is the name of the login cookie before a credential's own is appended
// (consoleAuth.cookieName), and the whole name an earlier version used.
const consoleCookie = "pepsi_console"

// consoleAuth holds the configured credential.
type consoleAuth struct {
	secret []byte // the token from CONSOLE_TOKEN_FILE
}

func (a *consoleAuth) mac(purpose string) string {
	m := hmac.New(sha256.New, a.secret)
	m.Write([]byte(purpose))
	return hex.EncodeToString(m.Sum(nil))
}

// consoleSessionLifetime bounds a login. The cookie is stateless, so logging out can only
// take it out of the browser: a copy of it (a shared machine's profile, a proxy's log) acted
// for ever when it was the credential's one fixed HMAC. It now carries its issue time.
const consoleSessionLifetime = 12 * time.Hour

// cookieName is the login cookie's name for this credential. A browser keeps one cookie per
// name and host, whatever the port: the consoles of two systems on one host (two listeners,
// two SSH tunnels to 127.0.0.1) each overwrote the other's login when they shared a name.
func (a *consoleAuth) cookieName() string {
	return consoleCookie + "_" + a.mac("pepsi-console cookie name")[:12]
}

// sessionValue is the cookie of a browser logged in at issued: the issue time in Unix
// seconds and its HMAC under the credential.
func (a *consoleAuth) sessionValue(issued time.Time) string {
	at := strconv.FormatInt(issued.Unix(), 10)
	return at + "." + a.mac("pepsi-console session "+at)
}

// session returns the request's cookie if it is a session of this credential issued less
// than consoleSessionLifetime ago (and not more than a minute ahead: a clock set back).
func (a *consoleAuth) session(r *http.Request) (string, bool) {
	ck, err := r.Cookie(a.cookieName())
	if err != nil {
		return "", false
	}
	at, mac, ok := strings.Cut(ck.Value, ".")
	if !ok || subtle.ConstantTimeCompare([]byte(mac), []byte(a.mac("pepsi-console session "+at))) != 1 {
		return "", false
	}
	sec, err := strconv.ParseInt(at, 10, 64)
	if err != nil {
		return "", false
	}
	age := time.Since(time.Unix(sec, 0))
	return ck.Value, age > -time.Minute && age < consoleSessionLifetime
}

// csrfToken is the session's own (session: its cookie's value): a token copied from a page
// acts only with its cookie, and expires with it.
func (a *consoleAuth) csrfToken(session string) string { return a.mac("pepsi-console csrf " + session) }

func (a *consoleAuth) csrfOK(r *http.Request, session string) bool {
	return subtle.ConstantTimeCompare([]byte(r.PostFormValue("csrf")), []byte(a.csrfToken(session))) == 1
}

// crossOrigin says why a POST does not come from a page of this listener ("" when it does):
// its Origin header, or its Referer when a browser sends no Origin, must name the host the
// request was sent to (the proxy's X-Forwarded-Host, or Host). The refusal names both, so
// that a proxy that passes the host without its port (nginx's $host) is found at once.
func crossOrigin(r *http.Request) string {
	src := r.Header.Get("Origin")
	if src == "" || src == "null" {
		src = r.Header.Get("Referer")
	}
	if src == "" {
		return "cross-origin request refused: the request carries no Origin or Referer"
	}
	u, err := url.Parse(src)
	if err != nil || u.Host == "" {
		return fmt.Sprintf("cross-origin request refused: its origin %q is not a URL", src)
	}
	host := r.Host
	if fwd := r.Header.Get("X-Forwarded-Host"); fwd != "" { // behind a reverse proxy
		host = strings.TrimSpace(strings.Split(fwd, ",")[0])
	}
	if strings.EqualFold(u.Host, host) {
		return ""
	}
	return fmt.Sprintf("cross-origin request refused: the request's origin is %s://%s, this console's host %s "+
		"(behind a reverse proxy, pass the browser's Host with its port: nginx's $http_host, not $host)", u.Scheme, u.Host, host)
}

// refuse answers a refused write.
func refuse(w http.ResponseWriter, code int, why string) {
	consoleHeaders(w)
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(code)
	w.Write([]byte(why + "\n")) // a client gone away is no error of ours
}

// refusedLogins rate-limits the "login refused" lines: one at once, then one per
// loginRefusedEvery at most, saying how many were left out. A client that tries credentials
// (or a monitor posting to /login) made a line per request, a log of thousands of lines a
// second, and journald's rate limit then dropped the dispatcher's own lines too
// (TestConsoleLoginRefusalsLogged).
type refusedLogins struct {
	mu       sync.Mutex // logins are the HTTP handlers', any number at once
	last     time.Time  // when the last line was logged
	unlogged int        // refusals since then, not logged
}

const loginRefusedEvery = 10 * time.Second

// admit reports whether a refusal at now is logged, and how many were left out before it.
func (l *refusedLogins) admit(now time.Time) (unlogged int, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.last.IsZero() && now.Sub(l.last) < loginRefusedEvery {
		l.unlogged++
		return 0, false
	}
	l.last = now
	unlogged, l.unlogged = l.unlogged, 0
	return unlogged, true
}

func (c *console) login(w http.ResponseWriter, r *http.Request) {
	if c.auth == nil {
		refuse(w, http.StatusForbidden, "the console is read-only: no credential is configured")
		return
	}
	if why := crossOrigin(r); why != "" {
		refuse(w, http.StatusForbidden, why)
		return
	}
	if subtle.ConstantTimeCompare([]byte(strings.TrimSpace(r.PostFormValue("token"))), c.auth.secret) != 1 {
		if unlogged, ok := c.refused.admit(time.Now()); ok {
			c.log.Warn("console: login refused", "remote", r.RemoteAddr, "refused_unlogged", unlogged)
		}
		refuse(w, http.StatusForbidden, "wrong credential")
		return
	}
	// No Path: the browser scopes the cookie to the directory of the login's address, the
	// console's root, with or without a proxy's prefix (consoleRoot), so that it is not sent
	// to the other applications, or another console, behind the same proxy.
	http.SetCookie(w, &http.Cookie{Name: c.auth.cookieName(), Value: c.auth.sessionValue(time.Now()),
		MaxAge: int(consoleSessionLifetime.Seconds()), HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil || r.Header.Get("X-Forwarded-Proto") == "https"})
	c.log.Info("console: operator logged in", "remote", r.RemoteAddr)
	seeOther(w, "./")
}

func (c *console) logout(w http.ResponseWriter, r *http.Request) {
	if why := crossOrigin(r); why != "" {
		refuse(w, http.StatusForbidden, why)
		return
	}
	if c.auth != nil {
		http.SetCookie(w, &http.Cookie{Name: c.auth.cookieName(), Value: "", MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	}
	// The login of an earlier version set the bare name with Path=/: that browser is logged
	// out too.
	http.SetCookie(w, &http.Cookie{Name: consoleCookie, Value: "", Path: "/", MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	seeOther(w, "./")
}

// action performs one operator action. Wiring to the operator's SQL functions: see
// consoleRun; the checks here come first, in this order, and each refusal changes nothing.
func (c *console) action(w http.ResponseWriter, r *http.Request) {
	if c.auth == nil {
		refuse(w, http.StatusForbidden, "the console is read-only: no credential is configured")
		return
	}
	if why := crossOrigin(r); why != "" {
		refuse(w, http.StatusForbidden, why)
		return
	}
	session, ok := c.auth.session(r)
	switch {
	case !ok:
		refuse(w, http.StatusForbidden, "log in first")
	case !c.auth.csrfOK(r, session):
		refuse(w, http.StatusForbidden, "the form's CSRF token is missing or stale: reload the page")
	case c.pool() == nil:
		refuse(w, http.StatusServiceUnavailable, "this dispatcher has no database pool yet (a standby?)")
	default:
		c.runAction(w, r, session)
	}
}

// loadConsoleToken reads CONSOLE_TOKEN_FILE once, at start-up before the privilege drop, so
// the file may be readable by root alone (a reload, as the service account, keeps the token
// read at start). A mistake is a configuration error at the key's line.
func (cfg *Config) loadConsoleToken() error {
	if cfg.Dispatch.ConsoleTokenFile == "" {
		return nil
	}
	tok, err := readConsoleToken(cfg.Dispatch.ConsoleTokenFile)
	if err != nil {
		return &configError{cfg.Dispatch.consoleTokenAt, "CONSOLE_TOKEN_FILE", err.Error()}
	}
	cfg.consoleToken = tok
	return nil
}

// readConsoleToken reads a credential file: not readable by others, one line of at least 16
// characters.
func readConsoleToken(path string) (string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", fmt.Errorf("read the console credential: %w", err)
	}
	if fi.Mode().Perm()&0o004 != 0 {
		return "", fmt.Errorf("the console credential %s is readable by everyone: chmod o-r it", path)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("read the console credential: %w", err)
	}
	// A byte order mark, which some editors write at the start of a file, is not part of
	// the credential: the operator types none.
	tok := bytes.TrimSpace(bytes.TrimPrefix(b, []byte("\uFEFF")))
	if len(tok) < 16 || bytes.ContainsAny(tok, "\r\n") {
		return "", fmt.Errorf("the console credential in %s must be one line of at least 16 characters", path)
	}
	return string(tok), nil
}

// addConsole builds the console served under / beside /metrics. Its pages read the pool
// through m.db, which the dispatcher stores once it exists: until then (a standby, or a
// dispatcher waiting for a writable server) they answer 503.
func (m *metricsServer) addConsole(token string) error {
	var auth *consoleAuth
	if token != "" {
		auth = &consoleAuth{secret: []byte(token)}
	}
	c, err := newConsole(m.db.Load, func() *metricsSnapshot { return m.snap.Load() }, auth,
		m.log.With("component", "console"), m.version)
	if err != nil {
		return err
	}
	m.console = c
	return nil
}
