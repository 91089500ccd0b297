package main

import (
	"reflect"
	"testing"
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
