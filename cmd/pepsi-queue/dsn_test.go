package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestBadDSNKeepsPassword: a DSN the driver cannot parse is a configuration error (exit 2)
// that says what is wrong with it, and neither the password nor a quoted fragment of it is
// printed, wherever the DSN came from (PEPSI_DSN or the file) and whichever of its forms is
// broken. pepsi-queue printed the whole URL, password and all, as "cannot reach the
// database" with exit 3.
func TestBadDSNKeepsPassword(t *testing.T) {
	t.Setenv("PGPASSWORD", "")
	quoted := regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)
	for _, c := range []struct{ dsn, pw, want string }{
		{"postgres://u:s3cretPW@host:badport/db", "s3cretPW", `invalid port ":badport" after host`},
		{"postgres://u:s3cretPW@ho st/db", "s3cretPW", "not a valid postgres:// URL"},
		{"postgres://u:ab%zzcd@h/db", "ab%zzcd", "not a valid postgres:// URL"},
		{"host=h dbname=db password='s3cretPW", "s3cretPW", "unterminated quoted string literal"},
		{"host=h password=s3cretPW sslmode=bogus", "s3cretPW", `wrong value for "sslmode"`},
		{"host=h password='s3cret PW' sslmode=verify-no", "s3cret PW", `wrong value for "sslmode"`},
		{`"postgres://u:s3cretPW@h/db"`, "s3cretPW", "starts with a quote"},
		{"Postgres://u:s3cretPW@h/db", "s3cretPW", `missing "="`},
		{`"host=h dbname=db password=s3cretPW"`, "s3cretPW", "starts with a quote"},
	} {
		check := func(from string, r result) {
			t.Helper()
			if r.code != exitUsage || !strings.Contains(r.stderr, "database DSN") || !strings.Contains(r.stderr, c.want) {
				t.Errorf("DSN %s (%s): exit %d, stderr %q; want %d and a DSN error: …%s", c.dsn, from, r.code, r.stderr, exitUsage, c.want)
			}
			out := r.stdout + r.stderr
			if strings.Contains(out, c.pw) {
				t.Errorf("DSN %s (%s): output %q contains the password", c.dsn, from, out)
			}
			// A driver's syntax error quotes the word it stopped at: part of the password.
			for _, q := range quoted.FindAllString(out, -1) {
				if s, err := strconv.Unquote(q); err == nil && len(s) > 1 && strings.Contains(c.pw, s) {
					t.Errorf("DSN %s (%s): output %q quotes %s of the password", c.dsn, from, out, q)
				}
			}
		}
		check("PEPSI_DSN", pqWith(t, c.dsn, "", "status"))

		conf := filepath.Join(t.TempDir(), "pepsi.conf")
		if err := os.WriteFile(conf, []byte("[database]\nDSN = "+c.dsn+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		t.Setenv("PEPSI_DSN", "")
		var out, errOut bytes.Buffer
		code := run(context.Background(), []string{"-c", conf, "status"}, strings.NewReader(""), &out, &errOut)
		check(conf, result{code, out.String(), errOut.String()})
	}

	// A setting of the environment that lib/pq refuses is a configuration error too, and the
	// environment's password is not printed either.
	t.Setenv("PGPASSWORD", "s3cretPW")
	t.Setenv("PGSSLMODE", "bogus")
	r := pqWith(t, "host=/nonexistent-dir port=1", "", "status")
	if r.code != exitUsage || !strings.Contains(r.stderr, "$PGSSLMODE") || strings.Contains(r.stderr, "s3cretPW") {
		t.Errorf("PGSSLMODE=bogus: exit %d, stderr %q; want %d, naming $PGSSLMODE", r.code, r.stderr, exitUsage)
	}
}
