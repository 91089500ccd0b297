package damon

import (
	"os"
	"testing"
)

func TestStatTicks(t *testing.T) {
	for _, c := range []struct {
		line string
		want int64
		ok   bool
	}{
		// A kernel thread as /proc shows it: utime 0, stime 9375.
		{"80 (kdamond.0) S 2 0 0 0 -1 2129984 0 0 0 0 0 9375 0 0 20 0 1 0 63 0 0", 9375, true},
		// A command name with spaces and a parenthesis of its own.
		{"7 (a b) c)) R 1 7 7 0 -1 4194560 100 0 0 0 12 30 0 0 20 0 1 0 5 0 0", 42, true},
		{"80 (kdamond.0) S 2 0", 0, false},
		{"no parenthesis", 0, false},
	} {
		got, ok := statTicks(c.line)
		if got != c.want || ok != c.ok {
			t.Errorf("statTicks(%q) = %d, %v; want %d, %v", c.line, got, ok, c.want, c.ok)
		}
	}
}

// TestStatTicksOwnProcess checks the parser against this kernel's /proc: the test's own stat
// line has the fields it counts.
func TestStatTicksOwnProcess(t *testing.T) {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	if _, ok := statTicks(string(b)); !ok {
		t.Fatalf("statTicks cannot read %q", b)
	}
}
