package main

import (
	"errors"
	"strings"
	"testing"

	"github.com/lib/pq"

	"pepsi-dispatch/internal/schemafile"
)

// TestIDsArePositive: a message or a group given an id of 0 or below by hand is refused at
// its INSERT, naming the rule. Every walk over the tables by id starts after 0 (retention's,
// queue_select's pages, fanin_sweep's) and the SDKs read an id line as digits, so such a row
// was never deleted, never listed or acted on by filter, and failed at every stage with "bad
// message id". A database made before the rule gets it when schema.sql is applied again; one
// that holds such rows is refused with their count, and gets the rule once they are gone.
func TestIDsArePositive(t *testing.T) {
	s := newTestSchema(t)
	refused := func(what, query, constraint string) {
		t.Helper()
		_, err := s.DB.Exec(query)
		var pe *pq.Error
		if !errors.As(err, &pe) || pe.Code != "23514" || pe.Constraint != constraint {
			t.Errorf("%s: err %v, want a check violation of %s", what, err, constraint)
		}
	}
	// A group's parent_id is its id here: (parent_id, generation) is unique.
	for _, id := range []string{"0", "-1", "-9223372036854775808"} {
		refused("a message with id "+id,
			`INSERT INTO workqueue (workqueue_id, stage) VALUES (`+id+`, 'a')`, "workqueue_id_positive")
		refused("a group with id "+id,
			`INSERT INTO fanout (fanout_id, parent_id, expected_n) VALUES (`+id+`, `+id+`, 1)`, "fanout_id_positive")
	}
	s.exec(t, `INSERT INTO workqueue (workqueue_id, stage) VALUES (9223372036854775807, 'a')`)
	s.exec(t, `INSERT INTO fanout (fanout_id, parent_id, expected_n) VALUES (9223372036854775807, 9223372036854775807, 1)`)

	ddl, err := schemafile.Read("schema.sql")
	if err != nil {
		t.Fatal(err)
	}
	// The earlier version's shape, with rows the rule refuses.
	s.exec(t, `ALTER TABLE workqueue DROP CONSTRAINT workqueue_id_positive`)
	s.exec(t, `ALTER TABLE fanout DROP CONSTRAINT fanout_id_positive`)
	s.exec(t, `INSERT INTO workqueue (workqueue_id, stage) VALUES (0, 'a'), (-5, 'a')`)
	s.exec(t, `INSERT INTO fanout (fanout_id, parent_id, expected_n) VALUES (-7, -7, 1)`)
	_, err = s.DB.Exec(ddl)
	if err == nil || !strings.Contains(err.Error(), "2 rows of workqueue have an id of 0 or below") {
		t.Fatalf("apply schema.sql over messages with ids 0 and -5: err %v, want them counted", err)
	}
	s.exec(t, `DELETE FROM workqueue WHERE workqueue_id <= 0`)
	_, err = s.DB.Exec(ddl)
	if err == nil || !strings.Contains(err.Error(), "1 rows of fanout have an id of 0 or below") {
		t.Fatalf("apply schema.sql over a group with id -7: err %v, want it counted", err)
	}
	s.exec(t, `DELETE FROM fanout WHERE fanout_id <= 0`)
	for pass := 1; pass <= 2; pass++ {
		if _, err := s.DB.Exec(ddl); err != nil {
			t.Fatalf("apply schema.sql once the rows are gone (pass %d): %v", pass, err)
		}
		if n := s.count(t, `SELECT count(*) FROM pg_constraint
		     WHERE conname IN ('workqueue_id_positive', 'fanout_id_positive') AND convalidated
		       AND connamespace = $1::regnamespace`, s.Name); n != 2 {
			t.Errorf("pass %d: %d of the two rules in force, want both, validated", pass, n)
		}
	}
	refused("a message with id 0 after the upgrade",
		`INSERT INTO workqueue (workqueue_id, stage) VALUES (0, 'a')`, "workqueue_id_positive")
}

// TestTimesAreFinite: a message given an infinite time is refused at its INSERT or UPDATE,
// naming the rule. A run_at of 'infinity' made the row paused until then, and the next due
// time the dispatcher reads (min(retry_at)) could not be read as a due time: every return
// of due rows and every claim failed, and no stage claimed again. An infinite created_at or
// status_at made every age fail ("cannot subtract infinite timestamps"). A far date is fine.
func TestTimesAreFinite(t *testing.T) {
	s := newTestSchema(t)
	for _, c := range []struct{ what, query string }{
		{"run_at infinity", `INSERT INTO workqueue (stage, run_at) VALUES ('a', 'infinity')`},
		{"run_at -infinity", `INSERT INTO workqueue (stage, run_at) VALUES ('a', '-infinity')`},
		{"created_at -infinity", `INSERT INTO workqueue (stage, created_at) VALUES ('a', '-infinity')`},
		{"status_at infinity", `INSERT INTO workqueue (stage, status_at) VALUES ('a', 'infinity')`},
		{"a paused row due at infinity", `INSERT INTO workqueue (stage, status, retry_at) VALUES ('a', 'paused', 'infinity')`},
	} {
		_, err := s.DB.Exec(c.query)
		var pe *pq.Error
		if !errors.As(err, &pe) || pe.Code != "23514" || pe.Constraint != "workqueue_times_finite" {
			t.Errorf("%s: err %v, want a check violation of workqueue_times_finite", c.what, err)
		}
	}
	s.exec(t, `INSERT INTO workqueue (stage, run_at) VALUES ('a', '9999-12-31')`)
	s.exec(t, `INSERT INTO workqueue (stage, status) VALUES ('a', 'held')`)

	ddl, err := schemafile.Read("schema.sql")
	if err != nil {
		t.Fatal(err)
	}
	// The earlier version's shape: no rule on times, and the status check from before held
	// and cancelled (operate.sql widens it; its lookup must not take the times' rule, which
	// names status_at, for it).
	s.exec(t, `ALTER TABLE workqueue DROP CONSTRAINT workqueue_times_finite`)
	s.exec(t, `DELETE FROM workqueue WHERE status = 'held'`)
	s.exec(t, `ALTER TABLE workqueue DROP CONSTRAINT workqueue_status_check`)
	s.exec(t, `ALTER TABLE workqueue ADD CONSTRAINT workqueue_status_check
	    CHECK (status IN ('pending', 'running', 'paused', 'waiting', 'done', 'failed'))`)
	s.exec(t, `INSERT INTO workqueue (stage, created_at) VALUES ('a', '-infinity')`)
	_, err = s.DB.Exec(ddl)
	if err == nil || !strings.Contains(err.Error(), "1 rows of workqueue have an infinite created_at, status_at, run_at or retry_at") {
		t.Fatalf("apply schema.sql over a message created at -infinity: err %v, want it counted", err)
	}
	s.exec(t, `DELETE FROM workqueue WHERE NOT isfinite(created_at)`)
	for pass := 1; pass <= 2; pass++ {
		if _, err := s.DB.Exec(ddl); err != nil {
			t.Fatalf("apply schema.sql once the row is gone (pass %d): %v", pass, err)
		}
		if n := s.count(t, `SELECT count(*) FROM pg_constraint WHERE conname = 'workqueue_times_finite' AND convalidated
		       AND connamespace = $1::regnamespace`, s.Name); n != 1 {
			t.Errorf("pass %d: the times' rule is not in force", pass)
		}
		s.exec(t, `INSERT INTO workqueue (stage, status) VALUES ('a', 'held'), ('a', 'cancelled')`)
	}
}
