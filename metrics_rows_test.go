// metrics_rows_test.go: the row gauges of /metrics stay present, at 0, when the queue is empty.

package main

import (
	"io"
	"net/http"
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
