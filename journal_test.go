// journal_test.go: the log's priorities for systemd's journal (journal.go).

package main

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestJournalPriorities: with its standard error connected to the journal (JOURNAL_STREAM
// names that file), every record starts with its syslog priority (sd-daemon(3)), so that
// journalctl -p warning finds the warnings: journald took every line at the unit's default
// priority, info. Workers, whose standard error is a pipe to the daemon, do not get
// JOURNAL_STREAM. Without it, no prefix.
func TestJournalPriorities(t *testing.T) {
	s := newTestSchema(t)
	script := writeFile(t, testDir(t), "say.sh", "#!/bin/sh\necho \"journal stream: ${JOURNAL_STREAM:-none}\" >&2\nwhile read id; do echo '1 no'; done\n")
	if err := os.Chmod(script, 0o755); err != nil {
		t.Fatal(err)
	}
	conf := writeFile(t, testDir(t), "pepsi.conf", baseConf(s, "")+fmt.Sprintf("[stage-a]\nPROGRAM = %s\nMAX_ATTEMPTS = 1\n", script))
	for _, journal := range []bool{true, false} {
		f, err := os.CreateTemp(t.TempDir(), "stderr")
		if err != nil {
			t.Fatal(err)
		}
		var st syscall.Stat_t
		if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(os.Args[0], "-c", conf, "-v", "serve")
		cmd.Env = append(os.Environ(), "PEPSI_TEST_DAEMON=1")
		if journal {
			cmd.Env = append(cmd.Env, fmt.Sprintf("JOURNAL_STREAM=%d:%d", st.Dev, st.Ino))
		}
		cmd.Stdout, cmd.Stderr = f, f
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		id := insertOne(t, s, "a", `{}`)
		waitFor(t, 30*time.Second, "the worker's line logged", func() bool {
			b, _ := os.ReadFile(f.Name())
			return strings.Contains(string(b), "journal stream: ")
		})
		waitFor(t, 30*time.Second, "the message failed", func() bool { return row(t, s, id).status == "failed" })
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
		b, _ := os.ReadFile(f.Name())
		log := string(b)
		for _, c := range []struct{ prefix, line string }{
			{"<6>", "msg=\"pepsi-dispatch starting\""},
			{"<7>", "msg=\"worker started\""},
			{"<4>", "journal stream: none"},
		} {
			want := c.prefix
			if !journal {
				want = "time="
			}
			found := false
			for _, l := range strings.Split(log, "\n") {
				if strings.Contains(l, c.line) {
					found = true
					if !strings.HasPrefix(l, want) {
						t.Errorf("journal %v: the line with %s does not start with %s:\n%s", journal, c.line, want, l)
					}
				}
			}
			if !found {
				t.Errorf("journal %v: no line with %s:\n%s", journal, c.line, log)
			}
		}
	}
}

// TestJournalPrefix: each level's priority; a line without a level goes as it is.
func TestJournalPrefix(t *testing.T) {
	for line, want := range map[string]string{
		"time=x level=ERROR msg=a\n":  "<3>time=x level=ERROR msg=a\n",
		"time=x level=WARN msg=a\n":   "<4>time=x level=WARN msg=a\n",
		"time=x level=INFO msg=a\n":   "<6>time=x level=INFO msg=a\n",
		"time=x level=DEBUG msg=a\n":  "<7>time=x level=DEBUG msg=a\n",
		"time=x level=INFO+2 msg=a\n": "<6>time=x level=INFO+2 msg=a\n",
		"usage: pepsi-dispatch\n":     "usage: pepsi-dispatch\n",
	} {
		if got := journalLine(line); got != want {
			t.Errorf("journalLine(%q) = %q, want %q", line, got, want)
		}
	}
}
