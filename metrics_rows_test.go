// metrics_rows_test.go: the row gauges of /metrics stay present, at 0, when the queue is empty,
// and Prometheus reads them whatever the stage names.

package main

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestMetricsRowsZero: with nothing queued, every configured stage still has pepsi_rows for
// every status, at 0 (an alert on pepsi_rows{status="failed"} > 0 must read false, not "no
// data"), and a stage's gauges return to 0 when its rows are gone.
func TestMetricsRowsZero(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	addr := freePort(t)
	conf := baseConf(s, "METRICS_LISTEN = "+addr) + stageConf(t, "a", "b", "") + stageConf(t, "b", "", "")
	d := startDaemon(t, conf, "pipeline")
	scrape := func() string {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return ""
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	var body string
	waitFor(t, 30*time.Second, "metrics with a snapshot", func() bool {
		body = scrape()
		return strings.Contains(body, `pepsi_stage_workers{stage="b"}`)
	})
	want := func(body string, lines ...string) {
		t.Helper()
		for _, l := range lines {
			if !strings.Contains(body, l+"\n") {
				t.Errorf("metrics lack %q:\n%s", l, body)
			}
		}
	}
	var zeros []string
	for _, st := range []string{"a", "b"} {
		for _, status := range []string{"failed", "held", "paused", "pending", "running", "waiting"} {
			zeros = append(zeros, `pepsi_rows{stage="`+st+`",status="`+status+`"} 0`)
		}
		zeros = append(zeros, `pepsi_oldest_pending_seconds{stage="`+st+`"} 0.000`)
	}
	want(body, zeros...)

	// A failed row shows, and the other statuses of its stage stay at 0.
	s.exec(t, `INSERT INTO workqueue (stage, status) VALUES ('b', 'failed')`)
	body = scrape()
	want(body, `pepsi_rows{stage="b",status="failed"} 1`, `pepsi_rows{stage="b",status="pending"} 0`,
		`pepsi_rows{stage="a",status="failed"} 0`)
	s.exec(t, `DELETE FROM workqueue`)
	want(scrape(), zeros...)
	d.stop()
}

// TestMetricsOddStageNames: a stage name is any text a producer inserts, and the row gauges
// carry it as a label. The exposition format escapes only a backslash, a double quote and a
// line feed in a label value (everything else is the value's own UTF-8); Go's %q, which wrote
// them before, also writes \t, \x1b or \u202e, which Prometheus refuses, and one such row made
// the whole of /metrics unreadable to it. Checked by Debian's promtool (the real parser), and
// by reading each label back by the format's rules to the names inserted.
func TestMetricsOddStageNames(t *testing.T) {
	promtool := promtoolPath(t)
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	addr := freePort(t)
	d := startDaemon(t, baseConf(s, "METRICS_LISTEN = "+addr)+stageConf(t, "a", "", ""), "pipeline")
	names := []string{"a", "tab\there", `quo"te`, `back\slash`, "new\nline", "cr\rhere", "esc\x1b[2J",
		"bell\a", "nbsp\u00a0é", "bidi\u202eevil", `\n`, `"`, `\`}
	for _, n := range names[1:] {
		s.exec(t, `INSERT INTO workqueue (stage, status) VALUES ($1, 'failed')`, n)
	}
	var body string
	waitFor(t, 30*time.Second, "metrics with the rows of every stage", func() bool {
		body = scrape(addr)
		return strings.Count(body, "\npepsi_oldest_pending_seconds{") == len(names)
	})

	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = strings.NewReader(body)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("promtool check metrics: %v: %s\n%s", err, out, body)
	}

	var got []string
	for _, line := range strings.Split(body, "\n") {
		rest, ok := strings.CutPrefix(line, `pepsi_oldest_pending_seconds{stage="`)
		if !ok {
			continue
		}
		v, tail, err := readLabelValue(rest)
		if err != nil || !strings.HasPrefix(tail, "} ") {
			t.Errorf("line %q: label value %q, then %q: %v", line, v, tail, err)
			continue
		}
		got = append(got, v)
	}
	slices.Sort(got)
	slices.Sort(names)
	if !slices.Equal(got, names) {
		t.Errorf("stage labels read back %q, want %q", got, names)
	}
	d.stop()
}

// readLabelValue reads a label value by the exposition format's rules, up to its closing
// quote: \\, \" and \n are the only escapes, anything else after a backslash is an error.
func readLabelValue(s string) (value, rest string, err error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '"':
			return b.String(), s[i+1:], nil
		case '\n':
			return "", "", errors.New("a line feed in a label value")
		case '\\':
			if i++; i == len(s) {
				return "", "", errors.New("a backslash at the end")
			}
			switch s[i] {
			case '\\', '"':
				b.WriteByte(s[i])
			case 'n':
				b.WriteByte('\n')
			default:
				return "", "", fmt.Errorf("invalid escape sequence \\%c", s[i])
			}
		default:
			b.WriteByte(c)
		}
	}
	return "", "", errors.New("no closing quote")
}

// promtoolPath finds Debian's promtool (package prometheus; CI extracts it without the
// server).
func promtoolPath(t *testing.T) string {
	t.Helper()
	return referenceTool(t, "PROMTOOL", "promtool", "the check of /metrics by Prometheus's own parser",
		"apt-get install -y prometheus")
}

// TestRunningRowsCounted: running rows have no index, so /metrics and the console's overview
// take their count from the dispatcher, not from the table; it must still be the table's
// count: the messages in workers' queues (here four a worker holds, never answering), and
// not the pending rows behind them.
func TestRunningRowsCounted(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	addr := freePort(t)
	conf := baseConf(s, "METRICS_LISTEN = "+addr) + stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 4")
	d := startDaemon(t, conf, "pipeline")
	enqueue(t, s, "a", 6, `{"hang_at": "a"}`)
	waitFor(t, 30*time.Second, "four rows running in the table", func() bool { return countStatus(t, s, "running") == 4 })
	waitFor(t, 5*time.Second, "/metrics counting them", func() bool {
		run, ok1 := metric(t, addr, `pepsi_rows{stage="a",status="running"}`)
		pend, ok2 := metric(t, addr, `pepsi_rows{stage="a",status="pending"}`)
		return ok1 && ok2 && run == 4 && pend == 2
	})
	if page := consoleOverview(t, addr); !strings.Contains(page, `href="./search?stage=a&amp;status=running">4<`) ||
		!strings.Contains(page, `href="./search?stage=a&amp;status=pending">2<`) {
		t.Errorf("the console's overview does not count 4 running and 2 pending rows:\n%s", page)
	}
	d.stop()
}
