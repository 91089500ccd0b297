// Package dsnsecret keeps the database password out of what pepsi's programs print: the
// daemon and pepsi-queue alike.
//
// It finds the password material of a DSN (valid or not) and of the environment, and removes
// it from a message, whole, quoted, and as the quoted fragment a driver's syntax error makes
// of it; Check reports a DSN the driver cannot parse without quoting the DSN. Messages are
// built not to quote the DSN in the first place; Redact is the backstop.
package dsnsecret

import (
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/lib/pq"
)

// redacted replaces a secret in output.
const redacted = "[redacted]"

// FromEnv returns the passwords set in the program's environment (the variables libpq and
// lib/pq take a password from).
func FromEnv() []string {
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

// Secrets returns the password material of dsn, as the driver reads it when the DSN parses,
// and by a lenient scan when it does not (so that an error about a broken DSN cannot quote
// part of the password): the URL's user-info password and password= query parameter, or the
// key=value form's password value, raw and unescaped.
func Secrets(dsn string) []string {
	var out []string
	add := func(s string) {
		if s != "" && !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	if cfg, err := pq.NewConfig(dsn); err == nil {
		add(cfg.Password)
	}
	// The URL form, wherever a "://" is: lib/pq takes a URL only at the very start and in
	// lower case, and parses one in quotes, in capitals or after a stray word as key=value,
	// whose error quotes it whole.
	for i := strings.Index(dsn, "://"); i >= 0; i = nextIndex(dsn, "://", i) {
		head, query, _ := strings.Cut(dsn[i+3:], "?")
		head, _, _ = strings.Cut(head, "#")
		// The password ends at an '@', the last one when it parses (a password may hold
		// one); in a broken DSN, at any of them.
		for at := strings.LastIndex(head, "@"); at >= 0; at = strings.LastIndex(head[:at], "@") {
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
	}
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		return out // lib/pq's URL: no key=value in it
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

// nextIndex returns the index of the next sep in s after the one at i, or -1.
func nextIndex(s, sep string, i int) int {
	j := strings.Index(s[i+len(sep):], sep)
	if j < 0 {
		return -1
	}
	return i + len(sep) + j
}

// quotedRe finds the Go-quoted strings of an error message ("…" with escapes).
var quotedRe = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)

// Redact returns msg with every secret replaced, and every quoted fragment that is part of a
// secret too: a driver's syntax error quotes the word it stopped at, which may be the second
// half of a password.
func Redact(msg string, secrets []string) string {
	msg = Replace(msg, secrets)
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

// Replace replaces each secret in s, as it is and as Go quoting (%q, the log's key=value
// quoting, once or twice nested) would print it. Unlike Redact it leaves quoted fragments
// alone, so it may run on any text (a log record, a worker's line), not only on an error.
func Replace(s string, secrets []string) string {
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
