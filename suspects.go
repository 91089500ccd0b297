// suspects.go: a worker that crashed or ran past MAX_RUNTIME with several messages read.
//
// dispatch.md charges the head of a dead worker's queue: a worker processes its ids one after
// another and answers each as it ends, so the head is the message it was running and the
// others "were never run". A worker that processes its ids as a batch (the SDKs do: the
// handlers of up to QUEUE_LIMIT messages in one transaction, answered at its commit) has run
// the head already when a later message of the batch hangs or crashes it, and the head's
// answer waits for the batch: the head was charged for the other's timeout, and the message
// at fault went back to pending without an attempt, to be batched again behind another head.
// One message whose handler hangs cost an attempt to the head of every batch it was in
// behind another (TestBatchHangChargesTheHanger: the innocent head failed after two
// timeouts; the longer the queue, the more such heads), and was charged only as a head.
//
// How many of its ids a worker had read is known through our end of its stdin pipe
// (FIONREAD: the unread bytes are the tail of what was written). When it had read one, that
// is the message it was running: charged as dispatch.md says. When it had read several,
// which of them ran past MAX_RUNTIME or crashed it cannot be told: none is charged, all go
// back to pending, and each of them runs next in a worker that has been given nothing else
// (alone), where a timeout or crash is its own. Until the suspects are claimed again, the
// stage gives each worker one message at a time (a worker given one could not batch it with
// another); the worker that has a suspect takes nothing more until it answers. A worker that
// dies so in its first seconds, before any answer, was running them, not failing to start:
// neither its stage's cool-down nor the poison rule of its head (supervise.go) applies
// (TestBatchCrashFreshWorker: the innocent head was taken for the poison and failed).

package main

import (
	"strconv"
	"time"
)

// suspectWait bounds how long a suspect that has not been claimed again (the stage paused
// or on cool-down, the row cancelled or finished by a batch that had committed) keeps its
// stage's workers at one message each; past it, it is claimed as any other message.
const suspectWait = 30 * time.Second

// suspectsLogged is how many of a dead worker's suspects its log line names (QUEUE_LIMIT may
// be up to 1,000).
const suspectsLogged = 10

// suspect is a message that was among several a dead worker had read.
type suspect struct {
	since    time.Time // when it became one, or went back to pending as one
	inFlight bool      // sent, alone, to an isolating worker
}

// readCount returns how many of q, w's unanswered messages in the order written, the worker
// had read from its stdin pipe, or -1 when that cannot be told (our end closed already, as
// a shutdown's grace does to let workers finish their queues, or the count refused). A line
// read in part counts as read.
func (w *worker) readCount(q []*message) int {
	if w.stdin == nil {
		return -1
	}
	unread, err := pipeUnread(w.stdin)
	if err != nil {
		return -1
	}
	n := len(q)
	for n > 0 {
		l := len(strconv.FormatInt(q[n-1].id, 10)) + 1
		if unread < l {
			break
		}
		unread -= l
		n--
	}
	return n
}

// updateAlone prunes the suspects that waited past suspectWait and sets whether the stage
// gives each worker one message at a time: while a suspect waits to be claimed.
func (p *pool) updateAlone(now time.Time) {
	p.alone = false
	for id, s := range p.suspects {
		switch {
		case s.inFlight:
		case now.Sub(s.since) > suspectWait:
			delete(p.suspects, id)
		default:
			p.alone = true
		}
	}
}

// markSuspects makes the messages a dead worker of p had read suspects, pending again.
func (p *pool) markSuspects(read []*message, now time.Time) {
	if p.suspects == nil {
		p.suspects = map[int64]suspect{}
	}
	for _, m := range read {
		p.suspects[m.id] = suspect{since: now}
	}
	p.alone = true
}

// isolate marks m, a suspect sent alone to w, as in flight: w takes nothing more until it
// answers (room).
func (p *pool) isolate(w *worker, m *message) {
	p.suspects[m.id] = suspect{since: p.suspects[m.id].since, inFlight: true}
	w.isolating = true
}

// isolationEnded is called when w, isolating, no longer holds its suspect m: answered or
// charged alone (resolved: no longer a suspect), or put back without an attempt for another
// reason (a retirement, an outage, a stop: a suspect again, pending).
func (p *pool) isolationEnded(w *worker, m *message, resolved bool, now time.Time) {
	w.isolating = false
	if p == nil {
		return
	}
	if resolved {
		delete(p.suspects, m.id)
	} else if _, ok := p.suspects[m.id]; ok {
		p.suspects[m.id] = suspect{since: now}
		p.alone = true
	}
}

// suspectRead puts back the queue q of w, dead, which had read read of them (more than one):
// none charged, the read ones suspects. The log line names the first suspectsLogged.
func (c *coordinator) suspectRead(w *worker, q []*message, read int, what, reason string, now time.Time) {
	ids := make([]int64, min(read, suspectsLogged))
	for i := range ids {
		ids[i] = q[i].id
	}
	c.log.Warn(what+" with several messages read: which of them it was running is not known; none is charged, they go back to pending and each runs next alone",
		"stage", w.stage, "pid", w.pid, "reason", reason, "read", read, "ids", ids, "requeued", len(q))
	if p := c.pools[w.stage]; p != nil {
		p.markSuspects(q[:read], now)
	}
	c.resets = append(c.resets, q...)
}
