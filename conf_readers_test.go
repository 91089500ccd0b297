package main

// The daemon's reader of pepsi.conf (parseINI) against the one pepsi-queue uses
// (internal/conffile): the same files accepted, the same DSN and stages read from them, and a
// rejection at the same line; and the same durations. The daemon reads its configuration with
// no code of the module's other packages, so the two are separate code; this is what keeps them
// one dialect.

import (
	"errors"
	"maps"
	"strings"
	"testing"

	"pepsi-dispatch/internal/conffile"
)

// compareReaders fails t when the two readers disagree on text.
func compareReaders(t *testing.T, text string) {
	t.Helper()
	entries, derr := parseINI("f", strings.NewReader(text))
	tf, terr := conffile.Parse("f", strings.NewReader(text))
	if (derr == nil) != (terr == nil) {
		t.Fatalf("the daemon says %v, pepsi-queue's reader says %v, on %q", derr, terr, text)
	}
	if derr != nil {
		var de *configError
		var te *conffile.Error
		if !errors.As(derr, &de) || !errors.As(terr, &te) {
			t.Fatalf("errors of unexpected types: %T %v, %T %v", derr, derr, terr, terr)
		}
		if de.Where != te.Where {
			t.Fatalf("the daemon rejects at %s (%v), pepsi-queue's reader at %s (%v), on %q", de.Where, derr, te.Where, terr, text)
		}
		return
	}
	dsn, stages := "", map[string]bool{}
	for _, e := range entries {
		if e.Section == "database" && e.Key == "DSN" {
			dsn = e.Value
		}
		if name, ok := strings.CutPrefix(e.Section, "stage-"); ok {
			stages[name] = true
		}
	}
	if dsn != tf.DSN {
		t.Fatalf("the daemon reads the DSN %q, pepsi-queue's reader %q, from %q", dsn, tf.DSN, text)
	}
	if !maps.Equal(stages, tf.Stages) {
		t.Fatalf("the daemon reads the stages %v, pepsi-queue's reader %v, from %q", stages, tf.Stages, text)
	}
}

// TestConfReaders: the rules of pepsi.conf(5), one file each, and the file a session found
// pepsi-queue refusing while the daemon ran on it (another program's section holding a line
// without '=').
func TestConfReaders(t *testing.T) {
	long := strings.Repeat("x", conffile.MaxLine-len("# "))
	for _, text := range []string{
		"",
		"[database]\nDSN = host=/tmp dbname=q\n[stage-a]\nPROGRAM = /bin/true\n",
		"[database]\r\nDSN = host=/tmp password=a=b \r\n",
		"[mailer]\n# another program's section\nverbose\n[database]\nDSN = x\n",
		"a line before any section without an equals sign\n[database]\nDSN = x\n",
		"KEY = before any section\n",
		"[database]\nDSN = a\n[database]\nDSN = b\n",
		"[database]\nDSN\n",
		"[database]\ndsn = lower-case key\n",
		"[database]\nDSN = a\x01b\n",
		"[database\nDSN = x\n",
		"[ ]\n",
		"[stage-\x01]\n",
		"[other\x01]\nanything = \x01\n",
		"[Database]\nDSN = not ours: case-sensitive\n",
		"[stage-a]\n[stage-b]\n[stage-a]\nNEXT = b\n",
		"[database]\n# " + long + "\nDSN = x\n",
		"[database]\n# " + long + "x\nDSN = x\n",
		"[database]\n# " + long + "\r\nDSN = x\n",
		"\uFEFF[database]\r\nDSN = a byte order mark first\r\n",
		"[database]\n\uFEFFDSN = a byte order mark later is text\n",
	} {
		compareReaders(t, text)
	}
	// The case above as pepsi-queue met it: accepted, with the DSN of [database].
	f, err := conffile.Parse("f", strings.NewReader("[database]\nDSN = host=/run/pg\n[mailer]\nverbose\n"))
	if err != nil || f.DSN != "host=/run/pg" {
		t.Fatalf("another program's section: %v, DSN %q", err, f.DSN)
	}
}

func FuzzConfReaders(f *testing.F) {
	for _, s := range []string{
		"[database]\nDSN = host=/tmp dbname=q\n[stage-a]\nPROGRAM = /bin/true\nNEXT = b c\n",
		"[mailer]\nverbose\n[database]\r\nDSN = a\n",
		"x\n[database]\nDSN = a\nDSN = b\n",
		"[stage-a]\n\tKEY\t=\tv\t\n; c\n# c\n[]\n",
		"\uFEFF[database]\nDSN = a\n",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		compareReaders(t, text)
	})
}

func FuzzDurations(f *testing.F) {
	for _, s := range []string{"30", "0.5", "250ms", "5 s", "2m", "1h", "7d", "1e3ms", "-1", "NaN", "1e300d", "0x10s", "1h30m"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		dd, derr := parseDuration(v)
		td, terr := conffile.ParseDuration(v)
		if (derr == nil) != (terr == nil) || dd != td {
			t.Fatalf("the daemon reads %q as %v (%v), pepsi-queue as %v (%v)", v, dd, derr, td, terr)
		}
	})
}
