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
