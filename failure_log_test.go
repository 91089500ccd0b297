// failure_log_test.go: the rate limit of the failure log lines.

package main

import (
	"strings"
	"testing"
	"time"
)

// TestFailureLogMixed: failures mixed among successes (every third message fails, each only
// once) used to log every failure, each followed by "stage recovered". Now a stage logs at
// most failureLinesPerMinute failure lines a minute, says how many it left out, and logs
// "stage recovered" only after a run of failures; a real run of failures still gets it.
func TestFailureLogMixed(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := baseConf(s, "") + stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 4\nMAX_ATTEMPTS = 1")
	s.exec(t, `INSERT INTO workqueue (stage, payload)
		SELECT 'a', CASE WHEN i % 3 = 0 THEN '{"fail_at": "a"}'::jsonb ELSE '{}' END
		  FROM generate_series(1, 300) AS i`)
	start := time.Now()
	d := startDaemon(t, conf, "pipeline")
	waitFor(t, 120*time.Second, "300 messages finished", func() bool {
		return countStatus(t, s, "done")+countStatus(t, s, "failed") == 300
	})
	elapsed := time.Since(start)
	log := d.log.String()
	failedLines := strings.Count(log, `msg="message failed"`)
	limit := failureLinesPerMinute * (int(elapsed/time.Minute) + 1)
	if failedLines == 0 || failedLines > limit {
		t.Errorf("%d 'message failed' lines for 100 failures in %v; want 1 to %d", failedLines, elapsed, limit)
	}
	if !strings.Contains(log, "next_failure_line_after=") {
		t.Errorf("no line says that failures are no longer logged")
	}
	if n := strings.Count(log, `msg="stage recovered"`); n != 0 {
		t.Errorf("%d 'stage recovered' lines after single failures; want 0", n)
	}

	// A run of failures (the last message above failed too), then a success: "stage
	// recovered" once.
	s.exec(t, `INSERT INTO workqueue (stage, payload)
		SELECT 'a', CASE WHEN i <= 5 THEN '{"fail_at": "a"}'::jsonb ELSE '{}' END
		  FROM generate_series(1, 6) AS i ORDER BY i`)
	d.waitLog(`msg="stage recovered" component=dispatch stage=a failures_before=`, 60*time.Second)
	d.stop()
	if n := strings.Count(d.log.String(), `msg="stage recovered"`); n != 1 {
		t.Errorf("%d 'stage recovered' lines after a run of failures; want 1", n)
	}
}
