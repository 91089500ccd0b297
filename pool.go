// pool.go: how many workers each stage runs, and which worker gets which message (the policy).
//
// A pool is elastic: workers are started when claimed messages need room, up to PARALLELISM;
// messages are packed onto as few workers as possible (the fullest worker that still has room
// first), so that surplus workers fall idle and are stopped after WORKER_IDLE_TIMEOUT. A
// worker that has been sent MAX_MESSAGES drains and is replaced on demand. A stage whose
// program cannot start, or dies before answering anything, is held for a cool-down that doubles
// up to holdMax, instead of being restarted in a loop (Postfix master_throttle); this file
// only reads the hold.
//
// The mechanism (start, stop, kill, reap, the hold) is supervise.go's, the process itself
// worker.go's; this file only decides, as Postfix's master_avail.c "invokes no code in other
// master_XXX modules". The coordinator goroutine owns every pool.

package main

import (
	"strings"
	"time"
)

// pool is the set of workers of one stage.
type pool struct {
	id      int // keys the stage's timers
	cfg     *StageConfig
	gen     int       // configuration generation; workers of older generations are retired
	workers []*worker // live workers started for this generation, in start order

	holdUntil time.Time     // no claims and no starts before this
	holdDelay time.Duration // the next cool-down

	// refusedUntil: the database refused this stage's claim by itself (claimStagesAlone); no
	// claim for it before this. refused: that was said, and its end is still to be said.
	refusedUntil time.Time
	refused      bool

	fuse    string          // PEPSI_FUSE for its workers: the stages they may run in the same pass
	fusable map[string]bool // the stages of fuse: the fused reports its workers may make

	// startupHead is the head message of the last worker that died before its first answer.
	// The same message at the head of a second such death is taken for a message that kills
	// its worker, not for a program that cannot start: it fails like a crash, so one poison
	// message cannot hold its stage for ever.
	startupHead int64

	// diskFullLog: the rate limit of the stage's "a disk was full" lines (diskfull.go).
	diskFullLog failureLog

	// smallPipeSaid: a worker's stdin pipe that holds fewer than QUEUE_LIMIT ids was logged.
	smallPipeSaid bool

	// suspects: messages that were among several a dead worker had read, none charged; each
	// runs next alone (suspects.go). alone: one of them waits to be claimed, so each worker
	// is given one message at a time.
	suspects map[int64]suspect
	alone    bool
}

// fuseList returns PEPSI_FUSE for stage name: every FUSE = yes stage reachable from it through
// NEXT links that all lead to FUSE = yes stages, each with its own NEXT list, as
// "STAGE=NEXT1,NEXT2 STAGE2=" in a stable order. A worker may run those stages in the pass of
// a message of this stage (stage fusion), if its program implements them; and those stages,
// the fused reports its workers may make.
func fuseList(stages map[string]*StageConfig, name string) (string, map[string]bool) {
	var out []string
	seen := map[string]bool{name: true}
	fusable := map[string]bool{}
	queue := []string{name}
	for len(queue) > 0 {
		s := stages[queue[0]]
		queue = queue[1:]
		for _, n := range s.Next {
			// A paused stage is not fused either: its predecessors' workers would run it. A
			// stage with a KEY_LIMIT is never fused: its limit is kept by the claim.
			if t := stages[n]; t != nil && t.Fuse && !t.Paused && t.KeyLimit == 0 && !seen[n] {
				seen[n] = true
				fusable[n] = true
				out = append(out, n+"="+strings.Join(t.Next, ","))
				queue = append(queue, n)
			}
		}
	}
	return strings.Join(out, " "), fusable
}

// running counts the workers that take new messages (draining ones are on their way out
// and do not count against PARALLELISM: capacity is bounded by in-flight messages anyway).
func (p *pool) running() int {
	n := 0
	for _, w := range p.workers {
		if w.state == workerRunning {
			n++
		}
	}
	return n
}

// room is how many more messages w can take now.
func (p *pool) room(w *worker) int {
	if w.state != workerRunning || w.isolating {
		return 0
	}
	limit := w.limit
	if p.alone {
		limit = 1
	}
	return min(limit-len(w.queue), p.cfg.MaxMessages-w.sent)
}

// capacity is how many messages the stage may have in flight: each running worker's limit
// (QUEUE_LIMIT, or what its stdin pipe holds), and QUEUE_LIMIT for each worker it may still
// start. Draining workers' messages count against it (the claim subtracts all in flight).
func (p *pool) capacity() int {
	n, running := 0, 0
	perNew := p.cfg.QueueLimit
	if p.alone {
		perNew = 1 // a suspect waits to be claimed (suspects.go)
	}
	for _, w := range p.workers {
		if w.state == workerRunning {
			n += min(w.limit, perNew)
			running++
		}
	}
	return n + max(0, p.cfg.Parallelism-running)*perNew
}

// pick returns the worker the next message should go to: the fullest one that still has room,
// so that work is packed and the others fall idle. nil means a new worker is needed.
func (p *pool) pick() *worker {
	var best *worker
	for _, w := range p.workers {
		if p.room(w) > 0 && (best == nil || len(w.queue) > len(best.queue)) {
			best = w
		}
	}
	return best
}

// canGrow reports whether the pool may start another worker.
func (p *pool) canGrow(now time.Time) bool {
	return !p.held(now) && p.running() < p.cfg.Parallelism
}

// remove drops w from the pool's list.
func (p *pool) remove(w *worker) {
	for i, x := range p.workers {
		if x == w {
			p.workers = append(p.workers[:i], p.workers[i+1:]...)
			return
		}
	}
}
