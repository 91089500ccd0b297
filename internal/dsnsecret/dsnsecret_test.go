package dsnsecret

import (
	"strings"
	"testing"
)

// TestRedact: secrets go whole, quoted, and as quoted fragments.
func TestRedact(t *testing.T) {
	for dsn, want := range map[string][]string{
		"password=s3cret dbname=x":         {"s3cret"},
		"password = 's3 cr\\'et' dbname=x": {"s3 cr'et"},
		"password=s3cret PW dbname=x":      {"s3cret PW"},
		"postgres://u:p%40ss@h/db":         {"p%40ss", "p@ss"},
		"postgres://u:pw@[bad/db":          {"pw"},
		"postgres://u@h/db?password=q%20w": {"q%20w", "q w"},
		`"postgres://u:s3cret@h/db"`:       {"s3cret"},
		"POSTGRESQL://u:s3cret@h/db":       {"s3cret"},
		"dsn=postgres://u:s3cret@h/db":     {"s3cret"},
	} {
		got := Secrets(dsn)
		for _, w := range want {
			found := false
			for _, g := range got {
				found = found || g == w
			}
			if !found {
				t.Errorf("Secrets(%q) = %q, lacks %q", dsn, got, w)
			}
		}
	}
	msg := Redact(`a "PW" b s3cret PW c "s3c\"ret"`, []string{"s3cret PW", `s3c"ret`})
	if strings.Contains(msg, "PW") || strings.Contains(msg, "s3c") {
		t.Errorf("redact: %q", msg)
	}
}

// FuzzCheckKeepsPassword: whatever surrounds a password in a DSN, in either form, Check's
// error does not repeat it (the fuzzer's words around it are the operator's mistakes).
func FuzzCheckKeepsPassword(f *testing.F) {
	for _, s := range []struct {
		a, b string
		form uint8
	}{
		{"host=h", "dbname=x", 0}, {"postgres", "h/db", 1}, {`"postgres`, `h/db"`, 1},
		{"POSTGRES", "h/db", 1}, {"x", "PW2 host=", 0}, {"dbname='mail", "", 2}, {"", "sslmode=bogus", 2},
		{"postgres", "h/db?sslmode=bogus", 1}, {`"host=h`, `"`, 0},
	} {
		f.Add(s.a, s.b, s.form)
	}
	const pw = "Zq7Xw9Vp"
	f.Fuzz(func(t *testing.T, a, b string, form uint8) {
		if strings.Contains(a+b, "Zq") || strings.Contains(a+b, "Vp") {
			t.Skip() // the words around it would repeat the password themselves
		}
		var dsn string
		switch form % 3 {
		case 0:
			dsn = a + " password=" + pw + " " + b
		case 1:
			dsn = a + "://u:" + pw + "@" + b
		default:
			dsn = a + " password='" + pw + "' " + b
		}
		if err := Check(dsn); err != nil && strings.Contains(err.Error(), pw) {
			t.Errorf("Check(%q) = %q: the password", dsn, err)
		}
	})
}
