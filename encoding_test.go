// encoding_test.go: a role whose client_encoding is not UTF8.

package main

import (
	"testing"
	"time"
)

// TestRoleClientEncoding runs a pipeline for a role whose client_encoding is LATIN1 (a legacy
// application's), with payloads holding characters LATIN1 has not. Under it the Python SDK's
// load failed every such message (test_role_client_encoding), until it asked for UTF8 when it
// connects; lib/pq, under the Go SDK and the dispatcher, always asks for UTF8 in its startup
// packet, which this holds it to.
func TestRoleClientEncoding(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	role := newTestRole(t, s, "pepsi_enc", "client_encoding = 'LATIN1'")
	const n = 50
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'parse', jsonb_build_object('city', 'Zürich 東京 ✓ 😀', 'i', i)
		FROM generate_series(1, $1) i`, n)
	conf := confAs(baseConf(s, ""), s, role) + stageConf(t, "parse", "deliver", "") + stageConf(t, "deliver", "", "")
	d := startDaemon(t, conf, "pipeline")
	waitFor(t, 60*time.Second, "all messages done", func() bool { return countStatus(t, s, "done") == n })
	d.stop()
	if failed := s.count(t, `SELECT count(*) FROM workqueue WHERE attempts > 0 OR state ? 'dispatch_error'`); failed != 0 {
		t.Errorf("%d messages failed at least once; the first: %s", failed, s.count0(t,
			`SELECT state->>'dispatch_error' FROM workqueue WHERE state ? 'dispatch_error' ORDER BY workqueue_id LIMIT 1`))
	}
	if runs := s.count(t, `SELECT count(*) FROM runs`); runs != 2*n {
		t.Errorf("%d runs recorded, want %d", runs, 2*n)
	}
}
