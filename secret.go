// secret.go: what the daemon must never print: the database password.
//
// It owns the extraction of password material from a DSN (valid or not) and from the
// environment, and the redacting writer every byte of the daemon's stderr goes through, so
// that no log line, error or worker message repeats a password, whatever wrapped it. Messages
// are built not to quote the DSN in the first place (checkDSN); this is the backstop.

package main

import (
	"io"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/lib/pq"
)

// redacted replaces a secret in output.
const redacted = "[redacted]"

// envSecrets returns the passwords set in the daemon's environment (the variables libpq and
// lib/pq take a password from).
func envSecrets() []string {
	var out []string
	for _, k := range []string{"PGPASSWORD"} {
		if v := os.Getenv(k); v != "" {
			out = append(out, v)
		}
	}
	return out
}

// nextKeyRe finds where an unquoted key=value value ends when it holds spaces by mistake
// (password=two words dbname=x): before the next word followed by '='.
var nextKeyRe = regexp.MustCompile(`\s+[A-Za-z_][A-Za-z0-9_]*\s*=`)

// passwordKeyRe finds a password key of the key=value form.
var passwordKeyRe = regexp.MustCompile(`(?:^|\s)password\s*=\s*`)

// dsnSecrets returns the password material of dsn, as the driver reads it when the DSN parses,
// and by a lenient scan when it does not (so that an error about a broken DSN cannot quote
// part of the password): the URL's user-info password and password= query parameter, or the
// key=value form's password value, raw and unescaped.
func dsnSecrets(dsn string) []string {
	var out []string
	add := func(s string) {
		if s != "" && !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	if cfg, err := pq.NewConfig(dsn); err == nil {
		add(cfg.Password)
	}
	if rest, ok := cutAnyPrefix(dsn, "postgres://", "postgresql://"); ok {
		head, query, _ := strings.Cut(rest, "?")
		head, _, _ = strings.Cut(head, "#")
		if at := strings.LastIndex(head, "@"); at >= 0 {
			if _, pw, ok := strings.Cut(head[:at], ":"); ok {
				add(pw)
				if u, err := url.PathUnescape(pw); err == nil {
					add(u)
				}
			}
		}
		query, _, _ = strings.Cut(query, "#")
		for _, kv := range strings.Split(query, "&") {
			if k, v, ok := strings.Cut(kv, "="); ok && k == "password" {
				add(v)
				if u, err := url.QueryUnescape(v); err == nil {
					add(u)
				}
			}
		}
		return out
	}
	for _, loc := range passwordKeyRe.FindAllStringIndex(dsn, -1) {
		v := dsn[loc[1]:]
		if strings.HasPrefix(v, "'") {
			var b strings.Builder
			for i := 1; i < len(v) && v[i] != '\''; i++ {
				if v[i] == '\\' && i+1 < len(v) {
					i++
				}
				b.WriteByte(v[i])
			}
			add(b.String())
			continue
		}
		if m := nextKeyRe.FindStringIndex(v); m != nil {
			v = v[:m[0]]
		}
		v = strings.TrimSpace(v)
		add(v)
		add(strings.ReplaceAll(v, `\`, ""))
	}
	return out
}

func cutAnyPrefix(s string, prefixes ...string) (string, bool) {
	for _, p := range prefixes {
		if rest, ok := strings.CutPrefix(s, p); ok {
			return rest, true
		}
	}
	return s, false
}

// quotedRe finds the Go-quoted strings of an error message ("…" with escapes).
var quotedRe = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)

// redact returns msg with every secret replaced, and every quoted fragment that is part of a
// secret too: a driver's syntax error quotes the word it stopped at, which may be the second
// half of a password.
func redact(msg string, secrets []string) string {
	msg = replaceSecrets(msg, secrets)
	return quotedRe.ReplaceAllStringFunc(msg, func(q string) string {
		s, err := strconv.Unquote(q)
		if err != nil || s == "" {
			return q
		}
		for _, sec := range secrets {
			if strings.Contains(sec, s) {
				return `"` + redacted + `"`
			}
		}
		return q
	})
}

// replaceSecrets replaces each secret in s, as it is and as Go quoting (%q, the log's
// key=value quoting, once or twice nested) would print it.
func replaceSecrets(s string, secrets []string) string {
	for _, sec := range secrets {
		if sec == "" {
			continue
		}
		q := sec
		for range 3 {
			s = strings.ReplaceAll(s, q, redacted)
			q = strings.Trim(strconv.Quote(q), `"`)
		}
	}
	return s
}

// redactor is the daemon's stderr: every write (one log record, or one line a worker wrote
// to its stderr, logged as a record) has the known secrets replaced before it goes out.
type redactor struct {
	w io.Writer

	mu      sync.Mutex // guards secrets: add runs at start-up while records may be written
	secrets []string   // longest first, so a secret that contains another goes whole
}

func newRedactor(w io.Writer) *redactor {
	r := &redactor{w: w}
	r.add(envSecrets()...)
	return r
}

// add makes the redactor replace secrets from now on.
func (r *redactor) add(secrets ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	all := slices.Clone(r.secrets) // a Write may be reading the old slice
	for _, s := range secrets {
		if s != "" && !slices.Contains(all, s) {
			all = append(all, s)
		}
	}
	slices.SortFunc(all, func(a, b string) int { return len(b) - len(a) })
	r.secrets = all
}

func (r *redactor) Write(p []byte) (int, error) {
	r.mu.Lock()
	secrets := r.secrets
	r.mu.Unlock()
	if len(secrets) == 0 {
		return r.w.Write(p)
	}
	if _, err := io.WriteString(r.w, replaceSecrets(string(p), secrets)); err != nil {
		return 0, err
	}
	return len(p), nil
}
