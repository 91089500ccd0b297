// dispatch_test.go: the dispatcher core against real PostgreSQL and real processes: the
// configuration, the claim, pools and pipelining, the pipeline end to end, the instance lock.

package main

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/lib/pq"
)

// ---- configuration ----

func TestConfigDefaults(t *testing.T) {
	dir := testDir(t)
	p := writeFile(t, dir, "c.conf", `
; a comment
[database]
DSN = host=/tmp dbname=x
[other-program]
whatever = lower-case keys are fine here
no equals sign either
[stage-a]
PROGRAM = /bin/true
NEXT = b
[stage-b]
PROGRAM = prog-b
`)
	cfg, err := loadConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	d := cfg.Dispatch
	if d.MaxRuntime != 300*time.Second || d.WorkerIdleTimeout != 5*time.Second || d.PollInterval != 30*time.Second ||
		d.StatsInterval != 60*time.Second || d.DBPoolSize != 8 || d.ConfigFile != "" || d.User != "pepsi" {
		t.Errorf("dispatch defaults: %+v", d)
	}
	a := cfg.Stages["a"]
	if a == nil || a.Parallelism != 4 || a.QueueLimit != 4 || a.MaxMessages != 1000 || a.MaxAttempts != 5 ||
		a.RetryDelay != 30*time.Second || len(a.Next) != 1 || a.Next[0] != "b" {
		t.Errorf("stage defaults: %+v", a)
	}
	if cfg.DSN != "host=/tmp dbname=x" {
		t.Errorf("DSN %q", cfg.DSN)
	}
}

func TestConfigErrors(t *testing.T) {
	dir := testDir(t)
	cases := []struct {
		name, text, want string
	}{
		{"unknown key", "[pepsi-dispatch]\nMAX_RUNTIM = 3\n", "c.conf:2: MAX_RUNTIM: unknown key"},
		{"bad duration", "[pepsi-dispatch]\nMAX_RUNTIME = soon\n", "c.conf:2: MAX_RUNTIME: want a duration"},
		{"negative duration", "[pepsi-dispatch]\nPOLL_INTERVAL = -1\n", "c.conf:2: POLL_INTERVAL: want a duration"},
		{"zero duration", "[pepsi-dispatch]\nMAX_RUNTIME = 0\n", "c.conf:2: MAX_RUNTIME: must be greater than zero"},
		{"bad number", "[database]\nDSN=dbname=x\n[stage-a]\nPROGRAM = p\nPARALLELISM = many\n", "c.conf:5: PARALLELISM: want a whole number"},
		{"queue limit too big", "[database]\nDSN=dbname=x\n[stage-a]\nPROGRAM = p\nQUEUE_LIMIT = 100000\n", "c.conf:5: QUEUE_LIMIT: want a whole number from 1 to 1000"},
		{"no program", "[database]\nDSN=dbname=x\n[stage-a]\nNEXT =\n", "c.conf:3: PROGRAM: [stage-a] has no PROGRAM"},
		{"next undefined", "[database]\nDSN=dbname=x\n[stage-a]\nPROGRAM = p\nNEXT = b\n", "c.conf:5: NEXT: names stage \"b\", which is not defined"},
		{"bad section name", "[stage-Big]\nPROGRAM = p\n", "c.conf:1: [stage-Big]: stage names are [a-z0-9_-]+"},
		{"empty stage name", "[stage-]\nPROGRAM = p\n", "c.conf:1: [stage-]: stage names are"},
		{"lower-case key", "[pepsi-dispatch]\nmax_runtime = 3\n", "c.conf:2: max_runtime: keys are upper-case"},
		{"duplicate key", "[pepsi-dispatch]\nMAX_RUNTIME = 3\nMAX_RUNTIME = 4\n", "c.conf:3: MAX_RUNTIME: set twice in [pepsi-dispatch] (first at c.conf:2)"},
		{"key outside section", "DSN = x\n", "c.conf:1: DSN: key outside any [section]"},
		{"unclosed header", "[database\n", "c.conf:1: section header"},
		{"no equals", "[database]\nDSN\n", "c.conf:2: expected KEY = value"},
		{"stages without DSN", "[stage-a]\nPROGRAM = p\n", "DSN: [database] DSN is required"},
		{"unknown database key", "[database]\nHOST = x\n", "c.conf:2: HOST: unknown key in [database]"},
		{"bad fuse", "[database]\nDSN=dbname=x\n[stage-a]\nPROGRAM = p\nFUSE = maybe\n", "c.conf:5: FUSE: want yes or no"},
		{"poolcounter listen", "[poolcounter]\nLISTEN = 7531\n", "c.conf:2: LISTEN: want host:port"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := writeFile(t, dir, "c.conf", tc.text)
			_, err := loadConfig(p)
			if err == nil {
				t.Fatalf("no error for %q", tc.text)
			}
			got := strings.ReplaceAll(err.Error(), dir+"/", "")
			if !strings.Contains(got, tc.want) {
				t.Errorf("error %q\nwant it to contain %q", got, tc.want)
			}
		})
	}
}

func TestConfigDurations(t *testing.T) {
	for in, want := range map[string]time.Duration{
		"300": 300 * time.Second, "0.5": 500 * time.Millisecond, "250ms": 250 * time.Millisecond,
		"5s": 5 * time.Second, "2m": 2 * time.Minute, "1h": time.Hour, "7d": 7 * 24 * time.Hour, "1.5s": 1500 * time.Millisecond,
	} {
		got, err := parseDuration(in)
		if err != nil || got != want {
			t.Errorf("parseDuration(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "s", "-1", "1x", "NaN", "1e300h", "ms5"} {
		if _, err := parseDuration(in); err == nil {
			t.Errorf("parseDuration(%q) accepted", in)
		}
	}
}

func TestConfigOverlay(t *testing.T) {
	dir := testDir(t)
	p := writeFile(t, dir, "c.conf", "[database]\nDSN=dbname=x\n[stage-a]\nPROGRAM = p\nNEXT = b\n")
	cfg, err := loadConfig(p)
	if err == nil {
		t.Fatalf("graph with undefined NEXT accepted from the file alone: %+v", cfg)
	}
	// The file alone names b, defined only by the overlay: loading the file reports it, and
	// the overlay completes the graph.
	p = writeFile(t, dir, "c.conf", "[database]\nDSN=dbname=x\n[stage-a]\nPROGRAM = p\n")
	cfg, err = loadConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	stages, err := buildStages(cfg.stageEntries, []overlayRow{
		{"stage-a", "NEXT", "b"}, {"stage-a", "PARALLELISM", "7"},
		{"stage-b", "PROGRAM", "q"}, {"pepsi-dispatch", "MAX_RUNTIME", "1"}, {"other", "X", "y"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if a := stages["a"]; a.Parallelism != 7 || a.Next[0] != "b" || stages["b"].Program != "q" {
		t.Errorf("overlay not applied: a=%+v b=%+v", a, stages["b"])
	}
	_, err = buildStages(cfg.stageEntries, []overlayRow{{"stage-a", "PARALLELISM", "x"}})
	if err == nil || !strings.Contains(err.Error(), `config table (section "stage-a"): PARALLELISM: want a whole number`) {
		t.Errorf("bad overlay value: %v", err)
	}
	_, err = buildStages(cfg.stageEntries, []overlayRow{{"stage-c", "NEXT", ""}})
	if err == nil || !strings.Contains(err.Error(), "[stage-c] has no PROGRAM") {
		t.Errorf("overlay stage without PROGRAM: %v", err)
	}
}

// FuzzINI: the parser never panics, and whatever it accepts round-trips through a rewrite.
func FuzzINI(f *testing.F) {
	f.Add("[database]\nDSN = x\n[stage-a]\nPROGRAM = p\nNEXT = \n")
	f.Add("; c\n# c\n\n[pepsi-dispatch]\nMAX_RUNTIME=1\n")
	f.Add("[x]\nfoo\n[stage-a]\n=\n")
	f.Add("[stage-a\n")
	f.Fuzz(func(t *testing.T, text string) {
		entries, err := parseINI("f", strings.NewReader(text))
		if err != nil {
			if _, ok := err.(*configError); !ok {
				t.Fatalf("error of type %T: %v", err, err)
			}
			return
		}
		var b strings.Builder
		for _, e := range entries {
			if e.Key == "" {
				fmt.Fprintf(&b, "[%s]\n", e.Section)
			} else {
				fmt.Fprintf(&b, "%s = %s\n", e.Key, e.Value)
			}
		}
		again, err := parseINI("g", strings.NewReader(b.String()))
		if err != nil {
			t.Fatalf("rewrite of accepted input rejected: %v\n%s", err, b.String())
		}
		if len(again) != len(entries) {
			t.Fatalf("rewrite has %d entries, want %d", len(again), len(entries))
		}
		for i := range again {
			if again[i].Section != entries[i].Section || again[i].Key != entries[i].Key || again[i].Value != entries[i].Value {
				t.Fatalf("entry %d: %+v, want %+v", i, again[i], entries[i])
			}
		}
	})
}

// ---- worker replies ----

func TestParseReply(t *testing.T) {
	good := map[string]reply{
		"0": {status: 0}, "0 done": {status: 0, text: "done", done: true}, "1 boom": {status: 1, text: "boom"},
		"12 a b  c": {status: 12, text: "a b  c"}, "007 x": {status: 7, text: "x"}, "0 ": {status: 0},
		"1 done": {status: 1, text: "done"}, // a failure's text is its reason, not outcome words
		"0 fused=b:3,c:4 done": {status: 0, text: "fused=b:3,c:4 done", done: true,
			fused: []fusedPass{{"b", 3}, {"c", 4}}},
		"0 fused=b:3,X:1,c:2": {status: 0, text: "fused=b:3,X:1,c:2", fused: []fusedPass{{"b", 3}},
			malformed: []string{"fused=b:3,X:1,c:2"}},
		"0 fused=b:-1 fused=c:0": {status: 0, text: "fused=b:-1 fused=c:0", fused: []fusedPass{{"c", 0}},
			malformed: []string{"fused=b:-1"}},
		"0 undone fused": {status: 0, text: "undone fused"},
	}
	for in, want := range good {
		got, err := parseReply(in)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("parseReply(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, in := range []string{"", " 0", "-1", "ok", "0x1", "1234567890", "0\tdone", "+1"} {
		if _, err := parseReply(in); err == nil {
			t.Errorf("parseReply(%q) accepted", in)
		}
	}
}

// FuzzReply covers the whole grammar: the status, and on success the outcome words.
func FuzzReply(f *testing.F) {
	for _, s := range []string{"0", "1 reason", "garbage", "0 fused=b:3,c:4 done", "", "0 fused=b:x,c:1", "0 done done fused=",
		"1 caf\xe9", "1 a\x00b", "1 " + strings.Repeat("€", 700)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		r, err := parseReply(line)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "protocol error:") {
				t.Fatalf("error without its kind: %v", err)
			}
			return
		}
		if r.status < 0 || !strings.HasPrefix(line, fmt.Sprint(r.status)) && !strings.HasPrefix(line, "0") {
			t.Fatalf("status %d from %q", r.status, line)
		}
		words := strings.Fields(r.text)
		if r.status != 0 && (r.done || r.fused != nil || r.malformed != nil) {
			t.Fatalf("outcome words parsed from a failure %q: %+v", line, r)
		}
		if r.status == 0 && r.done != slices.Contains(words, "done") {
			t.Fatalf("done = %v from %q", r.done, line)
		}
		// Rebuild the fused= words from the result: every pass must come from the text, in
		// order, and every malformed word must be a fused= word of the text.
		var passes []string
		for _, w := range words {
			if list, ok := strings.CutPrefix(w, "fused="); ok && r.status == 0 {
				passes = append(passes, strings.Split(list, ",")...)
			}
		}
		i := 0
	next:
		for _, p := range r.fused {
			if p.ms < 0 || !stageNameRe.MatchString(p.stage) {
				t.Fatalf("fused pass %+v from %q", p, line)
			}
			for ; i < len(passes); i++ {
				name, ms, _ := strings.Cut(passes[i], ":")
				if v, err := strconv.ParseInt(ms, 10, 64); err == nil && name == p.stage && v == p.ms {
					i++
					continue next
				}
			}
			t.Fatalf("fused pass %+v not in %q, in order", p, line)
		}
		for _, m := range r.malformed {
			if !strings.HasPrefix(m, "fused=") || !slices.Contains(words, m) {
				t.Fatalf("malformed word %q not a fused= word of %q", m, line)
			}
		}
		// What a failure's text becomes in state.dispatch_error is text PostgreSQL takes:
		// UTF-8, no NUL, within the bound (and its mark of a cut); a text that was all that
		// already, and short enough, is kept as it is.
		stored := storableReason(r.text)
		if !utf8.ValidString(stored) || strings.IndexByte(stored, 0) >= 0 || len(stored) > reasonMaxBytes+len("…") {
			t.Fatalf("reason %q stored as %q: not UTF-8, a NUL, or %d bytes", r.text, stored, len(stored))
		}
		if utf8.ValidString(r.text) && strings.IndexByte(r.text, 0) < 0 && len(r.text) <= reasonMaxBytes && stored != r.text {
			t.Fatalf("reason %q stored as %q: changed", r.text, stored)
		}
	})
}

// ---- the timer heap, against a model ----

func TestTimerHeapModel(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("PEPSI_TEST_SEED"); s != "" {
		fmt.Sscan(s, &seed)
	}
	t.Logf("seed %d (replay with PEPSI_TEST_SEED=%d)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	h := newTimerHeap()
	model := map[timerKey]time.Time{}
	base := time.Unix(1e9, 0)
	for i := 0; i < 20000; i++ {
		k := timerKey{timerKind(rng.IntN(4)), rng.IntN(20)}
		at := base.Add(time.Duration(rng.IntN(1000)) * time.Millisecond)
		switch rng.IntN(4) {
		case 0, 1:
			h.schedule(k, at)
			model[k] = at
		case 2:
			h.cancel(k)
			delete(model, k)
		case 3:
			now := base.Add(time.Duration(rng.IntN(1000)) * time.Millisecond)
			for {
				k, ok := h.popDue(now)
				if !ok {
					break
				}
				want, in := model[k]
				if !in || want.After(now) {
					t.Fatalf("step %d: popped %v (model %v, %v) at %v", i, k, want, in, now)
				}
				delete(model, k)
			}
			for k, at := range model {
				if !at.After(now) {
					t.Fatalf("step %d: %v due at %v not popped at %v", i, k, at, now)
				}
			}
		}
		if h.Len() != len(model) {
			t.Fatalf("step %d: heap has %d, model %d", i, h.Len(), len(model))
		}
	}
}

// ---- the claim ----

func openLockConn(t *testing.T, s *testSchema) *sql.Conn {
	t.Helper()
	conn, err := s.DB.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestFaninWakeRule checks when the coordinator flushes the fan-in inbox (fanin.go's due):
// at once when a hinted group may be complete (at the soonest 10 ms after the previous flush
// with fewer than 100 messages in flight, 50 ms with more), after FANIN_MIN_HINTS hints
// (50 ms), else FANIN_MAX_DELAY after the last flush; never while a flush runs.
func TestFaninWakeRule(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	cases := []struct {
		what      string
		lastFlush time.Time
		busy      bool
		inflight  int
		inbox     bool
		minHints  int           // FANIN_MIN_HINTS; 0: 100
		remaining map[int64]int // as the claims and flushes reported
		hinted    map[int64]int
		now       time.Time
		due       bool
		at        time.Time // zero: nothing pending
	}{
		{what: "nothing hinted", lastFlush: ms(0), now: ms(1000)},
		{what: "a flush is running", lastFlush: ms(0), busy: true, hinted: map[int64]int{1: 1}, now: ms(1000)},
		{what: "unknown group", lastFlush: ms(0), hinted: map[int64]int{1: 1}, now: ms(1000), due: true, at: ms(1000)},
		{what: "unknown group, right after a flush", lastFlush: ms(0), hinted: map[int64]int{1: 1}, now: ms(4), at: ms(10)},
		{what: "unknown group, right after a flush, busy", lastFlush: ms(0), inflight: 500, hinted: map[int64]int{1: 1}, now: ms(4), at: ms(50)},
		{what: "group may be complete, right after a flush", lastFlush: ms(0), remaining: map[int64]int{1: 3}, hinted: map[int64]int{1: 3}, now: ms(4), at: ms(10)},
		{what: "group may be complete, right after a flush, many status lines", lastFlush: ms(0), remaining: map[int64]int{1: 3, 2: 500}, hinted: map[int64]int{1: 3, 2: 97}, now: ms(4), at: ms(50)},
		{what: "group may be complete", lastFlush: ms(0), remaining: map[int64]int{1: 3}, hinted: map[int64]int{1: 3}, now: ms(500), due: true, at: ms(500)},
		{what: "group not complete: coalesce", lastFlush: ms(0), remaining: map[int64]int{1: 5}, hinted: map[int64]int{1: 2}, now: ms(100), at: ms(250)},
		{what: "group not complete, delay over", lastFlush: ms(0), remaining: map[int64]int{1: 5}, hinted: map[int64]int{1: 2}, now: ms(250), due: true, at: ms(250)},
		{what: "enough hints, soon after a flush", lastFlush: ms(0), remaining: map[int64]int{1: 500}, hinted: map[int64]int{1: 100}, now: ms(20), at: ms(50)},
		{what: "enough hints", lastFlush: ms(0), remaining: map[int64]int{1: 500}, hinted: map[int64]int{1: 100}, now: ms(60), due: true, at: ms(60)},
		{what: "few hints are enough, group may be complete, quiet", lastFlush: ms(0), minHints: 10, remaining: map[int64]int{1: 3, 2: 500}, hinted: map[int64]int{1: 3, 2: 20}, now: ms(4), at: ms(10)},
		{what: "few hints are enough, none complete", lastFlush: ms(0), minHints: 10, remaining: map[int64]int{1: 500}, hinted: map[int64]int{1: 20}, now: ms(4), at: ms(50)},
		{what: "many hints, group may be complete", lastFlush: ms(0), remaining: map[int64]int{1: 3, 2: 500}, hinted: map[int64]int{1: 3, 2: 150}, now: ms(4), at: ms(50)},
		{what: "the claim saw unapplied events", lastFlush: ms(0), inbox: true, now: ms(100), at: ms(250)},
	}
	for _, c := range cases {
		if c.minHints == 0 {
			c.minHints = 100
		}
		f := newFanin(DispatchConfig{FaninBatch: 10000, FaninMaxDelay: 250 * time.Millisecond, FaninMinHints: c.minHints}, &faninCounters{})
		f.lastFlush, f.busy, f.inbox = c.lastFlush, c.busy, c.inbox
		f.learn(c.remaining)
		for g, n := range c.hinted {
			for range n {
				f.hint(g)
			}
		}
		due, at := f.due(c.now, c.inflight)
		if due != c.due || !at.Equal(c.at) {
			t.Errorf("%s: due %v at +%v, want %v at +%v", c.what, due, at.Sub(t0), c.due, c.at.Sub(t0))
		}
	}
	// learn keeps the smaller estimate: counters only lag the children.
	f := newFanin(DispatchConfig{}, &faninCounters{})
	f.learn(map[int64]int{1: 10, 2: 4})
	f.learn(map[int64]int{1: 7, 2: 9})
	if f.remaining[1] != 7 || f.remaining[2] != 4 {
		t.Errorf("learn: remaining %v, want 1:7 2:4", f.remaining)
	}
}

func TestClaimCapacityOrderAndUnknownStages(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage) SELECT 'a' FROM generate_series(1, 10)`)
	s.exec(t, `INSERT INTO workqueue (stage) SELECT 'b' FROM generate_series(1, 3)`)
	s.exec(t, `INSERT INTO workqueue (stage) SELECT 'zz' FROM generate_series(1, 5)`) // no such stage
	s.exec(t, `INSERT INTO workqueue (stage, status, retry_at) VALUES ('a', 'paused', now() + interval '1 hour')`)
	conn := openLockConn(t, s)
	var cl claimer
	defer cl.close()
	ctx := context.Background()

	res, err := cl.claim(ctx, conn, map[string]int{"a": 4, "b": 8}, &keyLoad{})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.byStage["a"]) != 4 || len(res.byStage["b"]) != 3 || res.total != 7 {
		t.Fatalf("claimed %v", res.byStage)
	}
	var prev int64
	for _, m := range res.byStage["a"] {
		if m.id <= prev {
			t.Fatalf("stage a not in id order: %v", res.byStage["a"])
		}
		prev = m.id
	}
	if first := res.byStage["a"][0].id; first != int64(s.count(t, `SELECT min(workqueue_id) FROM workqueue WHERE stage='a' AND status <> 'paused'`)) {
		t.Errorf("claim did not start at the oldest row: %d", first)
	}
	claim := res.byStage["a"][0].claim
	for _, m := range append(res.byStage["a"], res.byStage["b"]...) {
		if m.claim != claim {
			t.Errorf("one statement, one claim token: %d vs %d", m.claim, claim)
		}
	}
	if res.nextRetry.IsZero() || time.Until(res.nextRetry) < 59*time.Minute {
		t.Errorf("next retry %v, want about an hour from now", res.nextRetry)
	}
	// The backlog drains in later claims, with a new token each time.
	res2, err := cl.claim(ctx, conn, map[string]int{"a": 100}, &keyLoad{})
	if err != nil {
		t.Fatal(err)
	}
	if len(res2.byStage["a"]) != 6 || res2.byStage["a"][0].claim == claim {
		t.Fatalf("second claim: %d rows, token %d (first %d)", len(res2.byStage["a"]), res2.byStage["a"][0].claim, claim)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'zz' AND status = 'pending'`); n != 5 {
		t.Errorf("rows of an unknown stage were touched: %d pending of 5", n)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'running'`); n != 13 {
		t.Errorf("%d running rows, want 13", n)
	}
}

func TestClaimUsesPartialIndex(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'a', 'done' FROM generate_series(1, 20000)`)
	s.exec(t, `INSERT INTO workqueue (stage) SELECT 'a' FROM generate_series(1, 10)`)
	s.exec(t, `ANALYZE workqueue`)
	rows, err := s.DB.Query(`EXPLAIN `+claimSQL, claimArgs([]string{"a"}, []int64{4})...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var plan strings.Builder
	for rows.Next() {
		var line string
		rows.Scan(&line)
		plan.WriteString(line + "\n")
	}
	if !strings.Contains(plan.String(), "workqueue_pending") {
		t.Errorf("claim plan does not use the partial pending index:\n%s", plan.String())
	}
}

// ---- the daemon end to end ----

// enqueue inserts n messages at stage with the given payload (JSON), returns nothing.
func enqueue(t testing.TB, s *testSchema, stage string, n int, payload string) {
	t.Helper()
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT $1, $2::jsonb FROM generate_series(1, $3)`, stage, payload, n)
}

func countStatus(t testing.TB, s *testSchema, status string) int {
	return s.count(t, `SELECT count(*) FROM workqueue WHERE status = $1`, status)
}

// TestPipelineExactlyOnce: thousands of messages through three stages; every message ends
// done, and each (message, stage) ran exactly once.
func TestPipelineExactlyOnce(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	const n = 3000
	conf := baseConf(s, "") +
		stageConf(t, "parse", "enrich", "PARALLELISM = 3\nQUEUE_LIMIT = 8\nMAX_MESSAGES = 100000") +
		stageConf(t, "enrich", "deliver", "PARALLELISM = 2\nQUEUE_LIMIT = 16\nMAX_MESSAGES = 100000") +
		stageConf(t, "deliver", "", "PARALLELISM = 2\nQUEUE_LIMIT = 8\nMAX_MESSAGES = 100000")
	d := startDaemon(t, conf, "pipeline")
	enqueue(t, s, "parse", n, `{}`)
	start := time.Now()
	waitFor(t, 120*time.Second, "all messages done", func() bool { return countStatus(t, s, "done") == n })
	elapsed := time.Since(start)
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1) x`); bad != 0 {
		t.Errorf("%d (message, stage) pairs ran other than once", bad)
	}
	if runs := s.count(t, `SELECT count(*) FROM runs`); runs != 3*n {
		t.Errorf("%d runs, want %d", runs, 3*n)
	}
	if left := s.count(t, `SELECT count(*) FROM workqueue WHERE status <> 'done' OR stage <> 'deliver'`); left != 0 {
		t.Errorf("%d rows not done at deliver", left)
	}
	for st, max := range map[string]int{"parse": 3, "enrich": 2, "deliver": 2} {
		if w := s.count(t, `SELECT count(DISTINCT pid) FROM runs WHERE stage = $1`, st); w < 1 || w > max {
			t.Errorf("stage %s used %d worker processes, want 1..%d", st, w, max)
		}
	}
	t.Logf("%d messages × 3 stages in %v (%.0f messages/s)", n, elapsed.Round(time.Millisecond), float64(n)/elapsed.Seconds())
	d.stop()
	if strings.Contains(d.log.String(), "level=ERROR") {
		t.Errorf("errors in the log:\n%s", d.log.String())
	}
}

// TestPipelining: a worker receives several ids before it answers any (one write per batch).
func TestPipelining(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	enqueue(t, s, "a", 4, `{}`)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 4"), "batch")
	waitFor(t, 30*time.Second, "4 done", func() bool { return countStatus(t, s, "done") == 4 })
	if b := s.count(t, `SELECT max(batch) FROM runs`); b != 4 {
		t.Errorf("largest batch a worker received before replying: %d, want 4", b)
	}
	d.stop()
}

// TestPackingAndGrowth: a trickle is packed onto one worker; a burst grows the pool to its cap.
func TestPackingAndGrowth(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 4\nQUEUE_LIMIT = 4"), "pipeline")
	enqueue(t, s, "a", 3, `{"sleep_ms": 50}`)
	waitFor(t, 30*time.Second, "3 done", func() bool { return countStatus(t, s, "done") == 3 })
	if w := s.count(t, `SELECT count(DISTINCT pid) FROM runs`); w != 1 {
		t.Errorf("3 messages within one worker's QUEUE_LIMIT ran on %d workers, want 1 (packing)", w)
	}
	s.exec(t, `TRUNCATE runs`)
	enqueue(t, s, "a", 40, `{"sleep_ms": 100}`)
	waitFor(t, 60*time.Second, "43 done", func() bool { return countStatus(t, s, "done") == 43 })
	if w := s.count(t, `SELECT count(DISTINCT pid) FROM runs`); w != 4 {
		t.Errorf("a burst of 40 slow messages ran on %d workers, want PARALLELISM = 4", w)
	}
	d.stop()
}

// TestIdleReaping: idle workers are stopped after WORKER_IDLE_TIMEOUT.
func TestIdleReaping(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := strings.Replace(baseConf(s, ""), "WORKER_IDLE_TIMEOUT = 2", "WORKER_IDLE_TIMEOUT = 0.3", 1)
	d := startDaemon(t, conf+stageConf(t, "a", "", "PARALLELISM = 2\nQUEUE_LIMIT = 1"), "pipeline")
	enqueue(t, s, "a", 6, `{"sleep_ms": 30}`)
	waitFor(t, 30*time.Second, "6 done", func() bool { return countStatus(t, s, "done") == 6 })
	rows, err := s.DB.Query(`SELECT DISTINCT pid FROM runs`)
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for rows.Next() {
		var p int
		rows.Scan(&p)
		pids = append(pids, p)
	}
	rows.Close()
	if len(pids) == 0 {
		t.Fatal("no worker recorded a run")
	}
	waitFor(t, 10*time.Second, "idle workers to exit", func() bool {
		for _, p := range pids {
			if syscall.Kill(p, 0) == nil {
				return false
			}
		}
		return true
	})
	d.waitLog("stopping idle worker", time.Second)
	d.stop()
}

// TestMaxMessagesRecycles: a worker is replaced after MAX_MESSAGES, once its pipeline drained.
func TestMaxMessagesRecycles(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 2\nMAX_MESSAGES = 5"), "pipeline")
	enqueue(t, s, "a", 20, `{}`)
	waitFor(t, 30*time.Second, "20 done", func() bool { return countStatus(t, s, "done") == 20 })
	if w := s.count(t, `SELECT count(DISTINCT pid) FROM runs`); w != 4 {
		t.Errorf("20 messages with MAX_MESSAGES = 5 ran on %d workers, want 4", w)
	}
	if m := s.count(t, `SELECT max(n) FROM (SELECT count(*) AS n FROM runs GROUP BY pid) x`); m > 5 {
		t.Errorf("a worker ran %d messages, over MAX_MESSAGES = 5", m)
	}
	d.stop()
}

// TestSingleInstance: a second dispatcher on the same system refuses to start.
func TestSingleInstance(t *testing.T) {
	s := newTestSchema(t)
	conf := baseConf(s, "") + stageConf(t, "a", "", "")
	first := startDaemon(t, conf, "pipeline")
	first.waitLog("single-instance lock taken", 30*time.Second)
	second := startDaemon(t, conf, "pipeline")
	if st := second.wait(30 * time.Second); st != 1 {
		t.Fatalf("second dispatcher exited with %d, want 1\n%s", st, second.log.String())
	}
	if !strings.Contains(second.log.String(), "another pepsi-dispatch is running for this system") {
		t.Errorf("refusal does not say why:\n%s", second.log.String())
	}
	// Another system (schema) in the same database is independent.
	other := newTestSchema(t)
	third := startDaemon(t, baseConf(other, "")+stageConf(t, "a", "", ""), "pipeline")
	third.waitLog("single-instance lock taken", 30*time.Second)
	third.stop()
	first.stop()
}

// TestExitStatusConfigError: a configuration mistake exits 2 naming file, line and key.
func TestExitStatusConfigError(t *testing.T) {
	dir := testDir(t)
	p := writeFile(t, dir, "bad.conf", "[pepsi-dispatch]\nPOLL_INTERVAL = often\n")
	for _, args := range [][]string{{"-c", p, "serve"}, {"serve", "extra"}, {"-c", p}, {"-L", "loud", "serve"}} {
		cmd := exec.Command(os.Args[0], args...)
		cmd.Env = append(os.Environ(), "PEPSI_TEST_DAEMON=1")
		out, err := cmd.CombinedOutput()
		ee, ok := err.(*exec.ExitError)
		if !ok || ee.ExitCode() != 2 {
			t.Errorf("%v: exit %v, want 2\n%s", args, err, out)
		}
		if args[0] == "-c" && len(args) == 3 && !strings.Contains(string(out), p+":2: POLL_INTERVAL:") {
			t.Errorf("message does not name file, line and key:\n%s", out)
		}
	}
}

// TestHelp: -h is answered with the usage and the options on standard output, exit 0
// (pepsi-dispatch -h | less); a mistake's usage stays on standard error.
func TestHelp(t *testing.T) {
	for _, arg := range []string{"-h", "-help", "--help"} {
		cmd := exec.Command(os.Args[0], arg)
		cmd.Env = append(os.Environ(), "PEPSI_TEST_DAEMON=1")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil || !strings.HasPrefix(string(out), "usage: pepsi-dispatch") || !strings.Contains(string(out), "-c file") || stderr.Len() != 0 {
			t.Errorf("%s: %v, stdout %q, stderr %q; want the usage on standard output, exit 0", arg, err, out, stderr.String())
		}
	}
	cmd := exec.Command(os.Args[0], "-x", "serve")
	cmd.Env = append(os.Environ(), "PEPSI_TEST_DAEMON=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 || len(out) != 0 || !strings.Contains(stderr.String(), "usage: pepsi-dispatch") {
		t.Errorf("-x: %v, stdout %q, stderr %q; want the usage on standard error, exit 2", err, out, stderr.String())
	}
}

// TestMissingSchema: start-up against a database without the schema says how to apply it.
func TestMissingSchema(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `DROP TABLE workqueue CASCADE`)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", ""), "pipeline")
	if st := d.wait(30 * time.Second); st != 1 {
		t.Fatalf("exit %d, want 1", st)
	}
	if !strings.Contains(d.log.String(), "psql -v ON_ERROR_STOP=1 -f schema.sql") {
		t.Errorf("no hint how to apply the schema:\n%s", d.log.String())
	}
}

func TestFuseList(t *testing.T) {
	st := func(next string, fuse bool) *StageConfig {
		return &StageConfig{Next: strings.Fields(next), Fuse: fuse}
	}
	stages := map[string]*StageConfig{
		"parse": st("enrich spam", false), "enrich": st("deliver", true), "deliver": st("", true),
		"spam": st("", false), "loop": st("loop", true),
	}
	for name, want := range map[string]string{
		"parse": "enrich=deliver deliver=", "enrich": "deliver=", "deliver": "", "spam": "", "loop": "",
	} {
		got, fusable := fuseList(stages, name)
		if got != want {
			t.Errorf("fuseList(%s) = %q, want %q", name, got, want)
		}
		for _, f := range strings.Fields(want) {
			stage, _, _ := strings.Cut(f, "=")
			if !fusable[stage] {
				t.Errorf("fuseList(%s): %s is not among the stages its workers may report fused (%v)", name, stage, fusable)
			}
		}
		if len(fusable) != len(strings.Fields(want)) {
			t.Errorf("fuseList(%s): %d stages its workers may report fused (%v), want %d", name, len(fusable), fusable, len(strings.Fields(want)))
		}
	}
}

func TestDSNWith(t *testing.T) {
	for in, want := range map[string]string{
		"host=/tmp dbname=x": "host=/tmp dbname=x application_name='pepsi-worker 7'",
		"":                   "application_name='pepsi-worker 7'",
		"postgres://u@h/db?options=-c%20search_path%3Ds": "postgres://u@h/db?application_name=pepsi-worker%207&options=-c%20search_path%3Ds",
	} {
		if got := dsnWith(in, "application_name", "pepsi-worker 7"); got != want {
			t.Errorf("dsnWith(%q) = %q, want %q", in, got, want)
		}
	}
	if got := dsnWith("dbname=x", "application_name", `it's\`); got != `dbname=x application_name='it\'s\\'` {
		t.Errorf("quoting: %q", got)
	}
}

// TestClaimPlanStaleStatistics: a queue table's statistics are always stale. Analyzed while
// nearly empty, then filled by a burst with a long claimed prefix, the claim must still pick
// through the partial pending index and update through the primary key, in a custom and in a
// generic (prepared, reused) plan alike.
func TestClaimPlanStaleStatistics(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage) SELECT 'a' FROM generate_series(1, 10)`)
	s.exec(t, `VACUUM ANALYZE workqueue`)
	s.exec(t, `INSERT INTO workqueue (stage) SELECT 'a' FROM generate_series(1, 20000)`)
	s.exec(t, `UPDATE workqueue SET status = 'done' WHERE workqueue_id < 8000`)
	conn := openLockConn(t, s)
	ctx := context.Background()
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		if _, err := conn.ExecContext(ctx, "SET plan_cache_mode = "+mode); err != nil {
			t.Fatal(err)
		}
		rows, err := conn.QueryContext(ctx, "EXPLAIN (ANALYZE, COSTS OFF) "+claimSQL, claimArgs([]string{"a"}, []int64{256})...)
		if err != nil {
			t.Fatal(err)
		}
		var plan strings.Builder
		for rows.Next() {
			var line string
			rows.Scan(&line)
			plan.WriteString(line + "\n")
		}
		rows.Close()
		p := plan.String()
		if !strings.Contains(p, "Index Only Scan using workqueue_pending") && !strings.Contains(p, "Index Scan using workqueue_pending") {
			t.Errorf("%s: the pick does not use the partial pending index:\n%s", mode, p)
		}
		if !strings.Contains(p, "Index Scan using workqueue_pkey on workqueue q") {
			t.Errorf("%s: the update does not find its rows by primary key:\n%s", mode, p)
		}
		if strings.Contains(p, "Rows Removed by Filter: 7") {
			t.Errorf("%s: the claim walks past the done prefix:\n%s", mode, p)
		}
	}
}

// claimArgs are claimSQL's parameters for stages with the given capacities.
func claimArgs(stages []string, caps []int64) []any {
	return []any{pq.Array(stages), pq.Array(caps)}
}
