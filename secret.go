// secret.go: what the daemon must never print: the database password.
//
// It owns the redacting writer every byte of the daemon's stderr goes through, so that no log
// line, error or worker message repeats a password, whatever wrapped it. The password material
// of a DSN and of the environment is found by internal/dsnsecret, which pepsi-queue shares.
// Messages are built not to quote the DSN in the first place (dsnsecret.Check); this is the
// backstop.

package main

import (
	"io"
	"slices"
	"sync"

	"pepsi-dispatch/internal/dsnsecret"
)

// redactor is the daemon's stderr: every write (one log record, or one line a worker wrote
// to its stderr, logged as a record) has the known secrets replaced before it goes out.
type redactor struct {
	w io.Writer

	mu      sync.Mutex // guards secrets: add runs at start-up while records may be written
	secrets []string   // longest first, so a secret that contains another goes whole
}

func newRedactor(w io.Writer) *redactor {
	r := &redactor{w: w}
	r.add(dsnsecret.FromEnv()...)
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
	if _, err := io.WriteString(r.w, dsnsecret.Replace(string(p), secrets)); err != nil {
		return 0, err
	}
	return len(p), nil
}
