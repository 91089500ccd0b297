package main

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestCounterTablesCoverEveryField: the counter tables are the only list of the counters, so
// a field without a row would be counted but never flushed nor shown. Each field must have
// exactly one row, and each row must read its own field.
func TestCounterTablesCoverEveryField(t *testing.T) {
	var c stageCounters
	seen := map[*int64]string{}
	for _, def := range stageCounterDefs {
		p := def.field(&c)
		if other, dup := seen[p]; dup {
			t.Errorf("stage counters %s and %s read the same field", other, def.column)
		}
		seen[p] = def.column
	}
	if n := reflect.TypeOf(c).NumField(); len(seen) != n {
		t.Errorf("stageCounterDefs covers %d fields of stageCounters' %d", len(seen), n)
	}

	// Set each global and fan-in field to a distinct value: every row must read a different one.
	var g globalCounters
	var f faninCounters
	v := int64(1)
	for _, s := range []any{&g, &f} {
		e := reflect.ValueOf(s).Elem()
		for i := 0; i < e.NumField(); i++ {
			e.Field(i).SetInt(v)
			v++
		}
	}
	got := map[int64]string{}
	for _, def := range dispatchCounterDefs {
		x := def.get(&g, &f)
		if other, dup := got[x]; dup {
			t.Errorf("dispatch counters %s and %s read the same field", other, def.column)
		}
		got[x] = def.column
	}
	if n := reflect.TypeOf(g).NumField() + reflect.TypeOf(f).NumField(); len(got) != n || len(dispatchCounterDefs) != n {
		t.Errorf("dispatchCounterDefs has %d rows reading %d fields, want %d", len(dispatchCounterDefs), len(got), n)
	}
}

// TestStatsFlushRefusedLoggedOnce: while the database refuses the statistics flush (a full
// disk did, TestDatabaseDiskFull; here an application's rule on stage_stats), an idle
// pipeline tries it every second and said so every second. It is logged once, then once a
// minute, and its end is said; the figures kept meanwhile are written then.
func TestStatsFlushRefusedLoggedOnce(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	// The sequence counts the refused flushes: nextval is not undone with the transaction.
	s.exec(t, `CREATE SEQUENCE stats_tries`)
	s.exec(t, `CREATE FUNCTION refuse_stats() RETURNS trigger LANGUAGE plpgsql AS $$
	    BEGIN PERFORM nextval('stats_tries'); RAISE EXCEPTION 'no statistics today'; END $$`)
	s.exec(t, `CREATE TRIGGER refuse_stats BEFORE INSERT OR UPDATE ON stage_stats FOR EACH ROW EXECUTE FUNCTION refuse_stats()`)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", ""), "pipeline")
	id := insertOne(t, s, "a", `{}`)
	waitFor(t, 30*time.Second, "message done", func() bool { return row(t, s, id).status == "done" })
	d.waitLog("statistics not flushed", 10*time.Second)
	// The idle pipeline's flush comes every second: five of them.
	waitFor(t, 30*time.Second, "five refused flushes", func() bool {
		return s.count(t, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM stats_tries`) >= 5
	})
	if n := strings.Count(d.log.String(), "statistics not flushed"); n != 1 {
		t.Errorf("five refused flushes were logged %d times, want once", n)
	}
	s.exec(t, `DROP TRIGGER refuse_stats ON stage_stats`)
	d.waitLog("statistics flushed again", 10*time.Second)
	if n := s.count(t, `SELECT processed FROM stage_stats WHERE stage = 'a'`); n != 1 {
		t.Errorf("stage_stats.processed = %d after the refusals, want 1", n)
	}
	d.stop()
}
