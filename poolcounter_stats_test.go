// poolcounter_stats_test.go: tests of the statistics (poolcounter_stats.go) that transcripts
// cannot reach: the time totals with a fake clock, the duration format, STATS FULL as the
// Prometheus exporter reads it, and /metrics.

package main

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestPoolCounterTimeStats checks the eight time lines with a fake clock, including the
// reference's defect (a handed-off lock's processing time counted its wait).
func TestPoolCounterTimeStats(t *testing.T) {
	s := newLockServer(pcTestLogger(t))
	now := time.Unix(1000, 0)
	s.now = func() time.Time { return now }
	s.start = now
	a, b, c, d := pcFakeConn(s, "a"), pcFakeConn(s, "b"), pcFakeConn(s, "c"), pcFakeConn(s, "d")
	defer func() {
		for _, x := range []*lockConn{a, b, c, d} {
			x.nc.Close()
		}
		s.handlers.Wait()
	}()
	do := func(conn *lockConn, line string) string {
		t.Helper()
		req := parsePoolCounterLine([]byte(line))
		s.mu.Lock()
		defer s.mu.Unlock()
		if req.op == pcOpRelease {
			return s.release(conn, now)
		}
		return s.acquire(conn, &req, now)
	}
	check := func(got, want string) {
		t.Helper()
		if got != want {
			t.Fatalf("got %q, want %q", got, want)
		}
	}
	check(do(a, "ACQ4ME k 1 10 60"), pcLocked)
	check(do(b, "ACQ4ME k 1 10 60"), "")  // waits from t=0
	check(do(c, "ACQ4ANY k 1 10 60"), "") // waits from t=0
	now = now.Add(2 * time.Second)
	check(do(a, "RELEASE"), pcReleased) // a held 2 s; c DONE (gained 2 s, waited 2 s); b LOCKED after 2 s
	now = now.Add(time.Second)
	check(do(b, "RELEASE"), pcReleased) // b held 1 s, not 3 s
	check(do(d, "ACQ4ME j 1 10 0"), pcLocked)
	check(do(a, "ACQ4ME j 1 10 5"), "")
	now = now.Add(5 * time.Second)
	s.mu.Lock()
	s.expireWaiters(now) // a times out after 5 s
	st := s.stats
	full := string(s.appendStats(nil, []byte("FULL"), now))
	s.mu.Unlock()
	if st.processingTime != 3*time.Second || st.processedCount != 2 || st.gainedTime != 2*time.Second ||
		st.waitingTime != 2*time.Second || st.waitingTimeForMe != 2*time.Second || st.waitingTimeForAnyone != 0 ||
		st.waitingTimeForGood != 2*time.Second || st.wastedTimeoutTime != 5*time.Second {
		t.Errorf("time stats: %+v", st)
	}
	for _, want := range []string{"total processing time: 3.000000s\n", "average processing time: 1.500000s\n",
		"gained time: 2.000000s\n", "waiting time: 2.000000s\n", "waiting time for good: 2.000000s\n",
		"wasted timeout time: 5.000000s\n", "uptime: 0 days, 0h 0m 8s\n"} {
		if !strings.Contains(full, want) {
			t.Errorf("STATS FULL lacks %q:\n%s", want, full)
		}
	}
	if err := s.checkInvariants(); err != nil {
		t.Error(err)
	}
	d0 := st
	s.mu.Lock()
	check(s.release(d, now), pcReleased)
	delta := s.stats.sub(d0)
	s.mu.Unlock()
	if delta.processedCount != 1 || delta.totalReleases != 1 || delta.processingTime != 5*time.Second || delta.processingWorkers != 0 {
		t.Errorf("sub: %+v", delta)
	}
}

// TestPoolCounterDurationFormat checks strtimeval's format, which exporters parse.
func TestPoolCounterDurationFormat(t *testing.T) {
	for _, tc := range []struct {
		d    time.Duration
		want string
	}{
		{0, "0.000000s"},
		{14276750 * time.Microsecond, "14.276750s"},
		{65 * time.Second, "1m 5.000000s"},
		{2*time.Hour + 3500*time.Millisecond, "2h 0m 3.500000s"},
		{73 * time.Hour, "3 days 1h 0m 0.000000s"},
		{-time.Second, "0.000000s"},
	} {
		if got := string(appendPCDuration(nil, tc.d)); got != tc.want {
			t.Errorf("%v: got %q, want %q", tc.d, got, tc.want)
		}
	}
}

// TestPoolCounterExporterParse reads STATS FULL the way the Prometheus exporter does: lines up
// to the first without ": ", durations through time.ParseDuration after removing spaces.
func TestPoolCounterExporterParse(t *testing.T) {
	_, addr := startOurs(t)
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(pcReplyDeadline)) //nolint:errcheck // the read fails if it did not apply
	io.WriteString(conn, "ACQ4ME k 1 1 0\nRELEASE\nSTATS FULL\n")
	sc := bufio.NewScanner(conn)
	for _, want := range []string{"LOCKED", "RELEASED"} {
		if !sc.Scan() || sc.Text() != want {
			t.Fatalf("got %q, want %q", sc.Text(), want)
		}
	}
	seen := 0
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), ": ")
		if !ok {
			break
		}
		seen++
		if name == "uptime" {
			continue // not parsed by the exporter
		}
		if strings.Contains(name, "time") {
			v := value
			if d, rest, ok := strings.Cut(v, " days "); ok {
				if _, err := strconv.Atoi(d); err != nil {
					t.Errorf("%s: days %q", name, d)
				}
				v = rest
			}
			if _, err := time.ParseDuration(strings.ReplaceAll(v, " ", "")); err != nil {
				t.Errorf("%s: %q does not parse: %v", name, value, err)
			}
		} else if name != "uptime" {
			if _, err := strconv.ParseInt(value, 10, 64); err != nil {
				t.Errorf("%s: %q is not an integer", name, value)
			}
		}
	}
	if seen != 21 {
		t.Errorf("read %d lines before the blank line, want 21", seen)
	}
}

// TestPoolCounterMetrics checks the Prometheus text output.
func TestPoolCounterMetrics(t *testing.T) {
	s := newLockServer(nil)
	c := pcFakeConn(s, "m")
	defer func() { c.nc.Close(); s.handlers.Wait() }()
	req := parsePoolCounterLine([]byte("ACQ4ME k 1 1 0"))
	s.mu.Lock()
	s.acquire(c, &req, s.clock())
	s.mu.Unlock()
	var b bytes.Buffer
	s.writeMetrics(&b)
	out := b.String()
	for _, want := range []string{
		"# TYPE pepsi_poolcounter_acquired_total counter\npepsi_poolcounter_acquired_total 1\n",
		"# TYPE pepsi_poolcounter_processing_workers gauge\npepsi_poolcounter_processing_workers 1\n",
		"pepsi_poolcounter_keys 1\n",
		"pepsi_poolcounter_waiting_seconds_total{type=\"me\"} 0\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("metrics lack %q:\n%s", want, out)
		}
	}
	for _, line := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
		if !strings.HasPrefix(line, "# HELP pepsi_poolcounter_") && !strings.HasPrefix(line, "# TYPE pepsi_poolcounter_") &&
			!regexp.MustCompile(`^pepsi_poolcounter_[a-z_]+(\{type="[a-z]+"\})? [0-9.e+-]+$`).MatchString(line) {
			t.Errorf("bad metrics line %q", line)
		}
	}
}
