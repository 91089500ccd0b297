package main

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestReadConf: pepsi-queue reads a file the daemon runs on, including another program's
// section with a line that is not KEY = value (pepsi.conf(5): ignored entirely, whatever it
// contains), and refuses a malformed one of pepsi's sections as a usage error.
func TestReadConf(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	p := write("ok.conf", "[database]\nDSN = host=/run/pg dbname=q\n\n[stage-deliver]\nPROGRAM = /bin/cat\n\n[mailer]\n# flags of another program\nverbose\n")
	c, err := readConf(p)
	if err != nil {
		t.Fatalf("readConf: %v", err)
	}
	if c.dsn != "host=/run/pg dbname=q" || !c.stages["deliver"] || len(c.stages) != 1 || c.path != p {
		t.Errorf("readConf = %+v", c)
	}
	_, err = readConf(write("bad.conf", "[database]\nDSN = a\n[stage-x]\nverbose\n"))
	var ue *usageError
	if !errors.As(err, &ue) || ue.Error() != filepath.Join(dir, "bad.conf")+`:4: expected KEY = value, got "verbose"` {
		t.Errorf("a line without '=' in [stage-x]: %v", err)
	}
	if _, err := readConf(filepath.Join(dir, "missing.conf")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a missing file: %v, want os.ErrNotExist", err)
	}
}

// TestParseDuration: --older takes Go's forms and every duration the daemon's configuration
// takes, the number of the latter trimmed before its unit and written in any float syntax.
func TestParseDuration(t *testing.T) {
	for v, want := range map[string]time.Duration{
		"90": 90 * time.Second, "1h30m": 90 * time.Minute, "7d": 7 * 24 * time.Hour, "0.5": 500 * time.Millisecond,
		"5 s": 5 * time.Second, "1e3ms": time.Second, "2 d": 48 * time.Hour, "250ms": 250 * time.Millisecond,
	} {
		if d, err := parseDuration(v); err != nil || d != want {
			t.Errorf("parseDuration(%q) = %v, %v; want %v", v, d, err, want)
		}
	}
	for _, v := range []string{"", "soon", "-5s", "-1", "NaN", "1e300d"} {
		if d, err := parseDuration(v); err == nil {
			t.Errorf("parseDuration(%q) = %v, want an error", v, d)
		}
	}
}
