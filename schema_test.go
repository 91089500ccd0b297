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
