package main

import (
	"strings"
	"testing"
	"time"
)

// batchOutcome is how one message of a batch test ended.
type batchOutcome struct {
	status   string
	attempts int
	runs     int
	reason   string
}

func batchOutcomes(t *testing.T, s *testSchema, ids []int64) []batchOutcome {
	t.Helper()
	out := make([]batchOutcome, len(ids))
	for i, id := range ids {
		if err := s.DB.QueryRow(`SELECT status, attempts, coalesce(state->>'dispatch_error', ''),
		        (SELECT count(*) FROM runs WHERE runs.id = w.workqueue_id)
		        FROM workqueue w WHERE workqueue_id = $1`, id).Scan(&out[i].status, &out[i].attempts, &out[i].reason, &out[i].runs); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// enqueueBatch inserts one message per payload, in order, in one statement, and returns
// their ids.
func enqueueBatch(t *testing.T, s *testSchema, stage string, payloads ...string) []int64 {
	t.Helper()
	return ids(t, s, `INSERT INTO workqueue (stage, payload)
	        SELECT $1, p::jsonb FROM unnest($2::text[]) WITH ORDINALITY AS x(p, n) ORDER BY n RETURNING workqueue_id`,
		stage, "{"+strings.Join(quoteAll(payloads), ",")+"}")
}

func quoteAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = `"` + strings.ReplaceAll(strings.ReplaceAll(s, `\`, `\\`), `"`, `\"`) + `"`
	}
	return out
}

// TestBatchHangChargesTheHanger: the SDK runs a worker's ids as a batch and answers them at
// its commit, so when the second message of a batch hangs, the head has run and waits for
// its answer. The head was charged with the timeout and the message at fault put back
// without an attempt, to be batched again behind another head: the head failed, innocent,
// after two timeouts, and the hanging one was charged only once it happened to be a head.
// Now the worker had read four ids, none is charged, each runs next alone: the hanging one
// times out alone (twice: MAX_ATTEMPTS = 2) and fails; the others are done, each run once,
// no attempt charged.
func TestBatchHangChargesTheHanger(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	ids := enqueueBatch(t, s, "a", `{}`, `{"hang_at": "a"}`, `{}`, `{}`)
	d := batchDaemon(t, s, "MAX_RUNTIME = 2", "MAX_ATTEMPTS = 2\nRETRY_DELAY = 0")
	waitBatchEnded(t, s, len(ids))
	d.stop()
	onlyCulpritCharged(t, s, ids, 1, 2, "timeout")
	if !strings.Contains(d.log.String(), "which of them it was running is not known") {
		t.Error("the log does not say why nobody was charged at the batch's timeout")
	}
}

// TestBatchCrashChargesTheCrasher: the same for a crash. A worker that has answered (so its
// death is not taken for a program that cannot start) is given a batch whose second message
// crashes it: before, the head failed at once (MAX_ATTEMPTS = 1), innocent.
func TestBatchCrashChargesTheCrasher(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := batchDaemon(t, s, "", "MAX_ATTEMPTS = 1")
	first := enqueueBatch(t, s, "a", `{}`)
	waitFor(t, 30*time.Second, "the first message done", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND status = 'done'`, first[0]) == 1
	})
	// The worker is idle; the next four ids reach it in one write, and the SDK reads them as
	// one batch (its first message takes less than the 100 ms that would close it).
	ids := enqueueBatch(t, s, "a", `{}`, `{"crash_at": "a"}`, `{}`, `{}`)
	waitBatchEnded(t, s, len(ids)+1)
	d.stop()
	onlyCulpritCharged(t, s, ids, 1, 1, "exited with status 3")
}

// onlyCulpritCharged checks that the message ids[culprit] failed after attempts attempts
// for a reason with the words why, and that the others are done, each run once, with no
// attempt charged.
func onlyCulpritCharged(t *testing.T, s *testSchema, ids []int64, culprit, attempts int, why string) {
	t.Helper()
	for i, o := range batchOutcomes(t, s, ids) {
		if i == culprit {
			if o.status != "failed" || o.attempts != attempts || !strings.Contains(o.reason, why) {
				t.Errorf("the message at fault, %d: %+v, want failed after %d attempts (%s)", ids[i], o, attempts, why)
			}
		} else if o.status != "done" || o.attempts != 0 || o.runs != 1 {
			t.Errorf("message %d (%d of the batch, innocent): %+v, want done, run once, no attempt charged", ids[i], i+1, o)
		}
	}
}

// TestBatchCrashFreshWorker: the crash of TestBatchCrashChargesTheCrasher in a worker's
// first batch, within its first seconds, where a death is first taken for a program that
// cannot start (the stage held a moment) and the same head twice for a message that kills
// its workers: that head was the batch's first, innocent, and failed.
func TestBatchCrashFreshWorker(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	ids := enqueueBatch(t, s, "a", `{}`, `{"crash_at": "a"}`, `{}`, `{}`)
	d := batchDaemon(t, s, "", "MAX_ATTEMPTS = 1")
	waitBatchEnded(t, s, len(ids))
	d.stop()
	onlyCulpritCharged(t, s, ids, 1, 1, "exited with status 3")
}

// batchDaemon starts a dispatcher with one stage, a, of one worker given up to four ids,
// which stays while idle: extra are [pepsi-dispatch] settings, opts the stage's.
func batchDaemon(t *testing.T, s *testSchema, extra, opts string) *daemon {
	t.Helper()
	conf := strings.Replace(baseConf(s, extra), "WORKER_IDLE_TIMEOUT = 2", "WORKER_IDLE_TIMEOUT = 30", 1) +
		stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 4\n"+opts)
	return startDaemon(t, conf, "pipeline")
}

// waitBatchEnded waits until n messages are done or failed.
func waitBatchEnded(t *testing.T, s *testSchema, n int) {
	t.Helper()
	waitFor(t, 60*time.Second, "every message of the batch ended", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status IN ('done', 'failed')`) == n
	})
}

// TestSuspectsAloneMode: the pool's rules for suspects, without processes. While a suspect
// waits to be claimed, every worker is given one message and the capacity counts one per
// worker; a worker running a suspect takes nothing more until it answers; a suspect answered
// or charged is one no more, one put back without an attempt waits again; one not claimed
// within suspectWait is forgotten, and the stage is pipelined again.
func TestSuspectsAloneMode(t *testing.T) {
	p := &pool{cfg: &StageConfig{Name: "a", Parallelism: 3, QueueLimit: 4, MaxMessages: 1000}}
	idle := &worker{state: workerRunning, limit: 4}
	busy := &worker{state: workerRunning, limit: 4, queue: []*message{{id: 9}}}
	p.workers = []*worker{idle, busy}
	if p.room(idle) != 4 || p.capacity() != 12 {
		t.Fatalf("no suspects: room %d, capacity %d; want 4 and 12", p.room(idle), p.capacity())
	}
	now := time.Now()
	m1, m2 := &message{id: 1}, &message{id: 2}
	p.markSuspects([]*message{m1, m2}, now)
	p.updateAlone(now)
	if !p.alone || p.room(idle) != 1 || p.room(busy) != 0 || p.capacity() != 3 {
		t.Fatalf("two suspects waiting: alone %v, rooms %d and %d, capacity %d; want true, 1, 0, 3",
			p.alone, p.room(idle), p.room(busy), p.capacity())
	}
	p.isolate(idle, m1)
	idle.queue = []*message{m1}
	p.updateAlone(now)
	if !p.alone || p.room(idle) != 0 {
		t.Fatalf("one suspect sent, one waiting: alone %v, room of the isolating worker %d; want true, 0", p.alone, p.room(idle))
	}
	p.isolationEnded(idle, m1, false, now) // put back without an attempt (an outage): waits again
	if idle.isolating || p.suspects[1].inFlight || !p.alone {
		t.Fatalf("a suspect put back: isolating %v, suspect %+v, alone %v", idle.isolating, p.suspects[1], p.alone)
	}
	p.isolate(idle, m1)         // claimed again, alone
	busy.queue = []*message{m2} // its message answered, the other suspect sent to it alone
	p.isolate(busy, m2)
	p.updateAlone(now)
	if p.alone || p.room(idle) != 0 || p.room(busy) != 0 {
		t.Fatalf("both suspects in flight: alone %v, rooms %d and %d; want false, 0, 0", p.alone, p.room(idle), p.room(busy))
	}
	p.isolationEnded(idle, m1, true, now) // answered
	idle.queue = nil
	if _, ok := p.suspects[1]; ok || idle.isolating || p.room(idle) != 4 {
		t.Fatalf("a suspect answered: still one %v, isolating %v, room %d; want no, no, 4", ok, idle.isolating, p.room(idle))
	}
	p.isolationEnded(busy, m2, false, now) // its worker retired: waits again, alone mode back
	if !p.alone {
		t.Fatal("a suspect put back waits to be claimed: want alone")
	}
	p.updateAlone(now.Add(suspectWait + time.Second))
	if p.alone || len(p.suspects) != 0 || p.room(idle) != 4 {
		t.Fatalf("a suspect not claimed within suspectWait: alone %v, %d suspects, room %d; want false, 0, 4",
			p.alone, len(p.suspects), p.room(idle))
	}
}
