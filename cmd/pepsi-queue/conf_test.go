package main

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
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
