// isolation_test.go: a database whose default isolation is not READ COMMITTED.

package main

import (
	"strings"
	"testing"
	"time"
)

// TestDatabaseDefaultSerializable runs a pipeline for a role whose default_transaction_isolation
// is SERIALIZABLE, as an application that wants it for its own writes sets it. The dispatcher's
// sessions must still run READ COMMITTED (doc/design/dispatch.md, section 5;
// internal/pgsession): serializable, its claim was refused by the database (40001) and
// waited a second at a time. So must the workers' batch transactions (BEGIN ISOLATION LEVEL
// READ COMMITTED, stage/conn.go): serializable, a batch of many messages takes a predicate lock
// on the whole queue table, every concurrent batch failed another, and each failure failed
// every message of its batch and charged it an attempt (233 of 1,000 messages with eight tries
// per batch). What a worker sends alone (the outcomes of handlers that wrote nothing, in one
// statement after the batch) runs at the role's level, and is sent again after a serialization
// failure (stage/transient.go). An application's statement trigger records the level each row's
// UPDATE ran at, and who sent it.
func TestDatabaseDefaultSerializable(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	role := newTestRole(t, s, "pepsi_ser", "default_transaction_isolation = 'serializable'")
	s.exec(t, `CREATE TABLE iso_seen (app text NOT NULL, iso text NOT NULL, id bigint NOT NULL)`)
	s.exec(t, `CREATE FUNCTION iso_seen() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO iso_seen SELECT current_setting('application_name'), current_setting('transaction_isolation'),
				workqueue_id FROM iso_new;
			RETURN NULL;
		END $$`)
	s.exec(t, `CREATE TRIGGER iso_seen AFTER UPDATE ON workqueue REFERENCING NEW TABLE AS iso_new
		FOR EACH STATEMENT EXECUTE FUNCTION iso_seen()`)

	const n = 1000
	conf := confAs(baseConf(s, ""), s, role) +
		stageConf(t, "parse", "enrich", "PARALLELISM = 3\nQUEUE_LIMIT = 8") +
		stageConf(t, "enrich", "deliver", "PARALLELISM = 2\nQUEUE_LIMIT = 16") +
		stageConf(t, "deliver", "", "PARALLELISM = 2\nQUEUE_LIMIT = 8")
	d := startDaemon(t, conf, "pipeline")
	// Every other message's handlers write nothing (no_run): their outcomes are kept and
	// written alone.
	s.exec(t, `INSERT INTO workqueue (stage, payload)
		SELECT 'parse', CASE WHEN i % 2 = 0 THEN '{}' ELSE '{"no_run": true}' END::jsonb FROM generate_series(1, $1) i`, n)
	waitFor(t, 120*time.Second, "all messages done", func() bool { return countStatus(t, s, "done") == n })
	d.stop()

	if bad := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1) x`); bad != 0 {
		t.Errorf("%d (message, stage) pairs ran other than once", bad)
	}
	if runs := s.count(t, `SELECT count(*) FROM runs`); runs != 3*n/2 {
		t.Errorf("%d runs recorded, want %d", runs, 3*n/2)
	}
	if failed := s.count(t, `SELECT count(*) FROM workqueue WHERE attempts > 0 OR state ? 'dispatch_error'`); failed != 0 {
		t.Errorf("%d messages failed at least once; the first: %s", failed, s.count0(t,
			`SELECT state->>'dispatch_error' FROM workqueue WHERE state ? 'dispatch_error' ORDER BY workqueue_id LIMIT 1`))
	}
	if got := s.count(t, `SELECT count(*) FROM iso_seen WHERE app LIKE 'pepsi-dispatch%'`); got == 0 {
		t.Fatalf("no UPDATE of the dispatcher's was seen (the trigger or the application name changed?)")
	}
	if got := s.count0(t, `SELECT string_agg(DISTINCT iso, ',') FROM iso_seen WHERE app LIKE 'pepsi-dispatch%'`); got != "read committed" {
		t.Errorf("the dispatcher's UPDATEs ran at %q, want read committed", got)
	}
	// The outcome of a message whose handler wrote is in the batch transaction; the others'
	// are kept, sent alone after it.
	workers := `SELECT string_agg(DISTINCT iso, ',') FROM iso_seen JOIN workqueue w ON w.workqueue_id = iso_seen.id
		 WHERE app LIKE 'pepsi-worker%' AND coalesce((w.payload->>'no_run')::boolean, false) = $1`
	if got := s.count0(t, workers, false); got != "read committed" {
		t.Errorf("the workers' UPDATEs in their batch transactions ran at %q, want read committed", got)
	}
	if got := s.count0(t, workers, true); got != "serializable" {
		t.Errorf("the workers' outcome statements alone ran at %q, want the role's serializable", got)
	}
	for _, line := range []string{"refused this stage's claim", "message failed", "level=ERROR"} {
		if strings.Contains(d.log.String(), line) {
			t.Errorf("the log says %q:\n%s", line, d.log.String())
		}
	}
	t.Logf("batches run again after a serialization failure: %d log lines",
		strings.Count(d.log.String(), "running it again"))
}
