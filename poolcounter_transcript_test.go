// poolcounter_transcript_test.go: the lock service's behaviour as transcripts.
//
// Owns: the transcript table (client, line sent, reply expected) that covers every rule of
// doc/design/lockservice.md, its runner, the servers under test (ours on 127.0.0.1:0 and
// Debian's poolcounterd 1.1.3 on a listener handed over as fd 0), and the side-by-side
// comparison. What transcripts cannot reach is tested beside each file (poolcounter_*_test.go:
// time statistics, accept back-off, slow clients, shutdown, framing fuzz). Needs no PostgreSQL.
//
// Synchronisation never sleeps: a request that must be queued before the next step is
// confirmed by polling STATS waiting_workers on an observer connection; every read has a
// deadline. The only waits on time are the behaviour under test (1-second lock timeouts and
// "nothing arrives for N seconds" checks).

package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Client indexes used in transcripts.
const (
	pcA = iota
	pcB
	pcC
	pcD
	pcE
)

// pcStep is one line of a transcript. Fields are combined in this order: send, halfClose,
// queued, want/wantRaw/re, silent, eof, close, until, sync.
type pcStep struct {
	c         int           // client index
	send      string        // line sent on c; "\n" is appended unless raw
	raw       bool          // send exactly these bytes
	halfClose bool          // shutdown(SHUT_WR) on c after sending; the server must close (EOF)
	queued    bool          // the request waits: block until the server counts one more waiter
	want      string        // next reply on c: this line ("\n" appended)
	wantRaw   string        // next reply on c: exactly these bytes
	re        string        // next reply on c: one line matching this regexp (anchored)
	full      bool          // with re: a STATS FULL block up to and including its empty line
	slow      bool          // the reply comes after a lock timeout: allow 3 s
	silent    time.Duration // c must receive nothing for this long
	close     bool          // close c (a later step on c opens a new connection)
	until     string        // then poll "STATS <name>" on the observer until it answers this
	sync      bool          // then two observer round trips: the server has read all bytes sent
	only      string        // "ours" or "ref": the step runs against one implementation only
}

type pcTranscript struct {
	name string
	// deviation names the section 16 defect this transcript shows fixed ("" = same behaviour);
	// its "ours"/"ref" steps give each side's replies.
	deviation string
	// refDrift: the reference leaks waiting_workers here, skip its final "all free" check.
	refDrift bool
	steps    []pcStep
}

func acq(c int, line, reply string) pcStep { return pcStep{c: c, send: line, want: reply} }
func queued(c int, line string) pcStep     { return pcStep{c: c, send: line, queued: true} }
func expect(c int, reply string) pcStep    { return pcStep{c: c, want: reply} }

// pcDur matches a duration of STATS FULL; pcFullRE builds the whole block with exact counters.
const pcDur = `(((\d+ days )?\d+h )?\d+m )?\d+\.\d{6}s`

func pcFullRE(counters ...int) string {
	names := []string{"total_acquired", "total_releases", "hashtable_entries", "processing_workers",
		"waiting_workers", "connect_errors", "failed_sends", "full_queues", "lock_mismatch",
		"lock_while_waiting", "release_mismatch", "processed_count"}
	var b strings.Builder
	b.WriteString(`uptime: \d+ days, \d+h \d+m \d+s\n`)
	for _, n := range []string{"total processing time", "average processing time", "gained time",
		"waiting time", "waiting time for me", "waiting time for anyone", "waiting time for good",
		"wasted timeout time"} {
		b.WriteString(n + ": " + pcDur + `\n`)
	}
	for i, n := range names {
		v := `\d+`
		if i < len(counters) {
			v = strconv.Itoa(counters[i])
		}
		b.WriteString(n + ": " + v + `\n`)
	}
	b.WriteString(`\n`)
	return b.String()
}

// pcTranscripts covers doc/design/lockservice.md rule by rule; each comment names its section.
func pcTranscripts() []pcTranscript {
	long1023 := "ACQ4ME " + strings.Repeat("k", 1023-len("ACQ4ME ")-len(" 1 1 0")) + " 1 1 0"
	long1024 := "ACQ4ME " + strings.Repeat("k", 1024-len("ACQ4ME ")-len(" 1 1 0")) + " 1 1 0"
	long5000 := "ACQ4ME " + strings.Repeat("x", 5000) + " 1 1 0"
	return []pcTranscript{
		{name: "commands", steps: []pcStep{ // Requests: command recognition; Framing: CR
			acq(pcA, "GARBAGE", "ERROR BAD_COMMAND"),
			acq(pcA, "acq4me k 1 1 0", "ERROR BAD_COMMAND"),
			acq(pcA, "ACQ4ME", "ERROR BAD_COMMAND"),
			acq(pcA, "ACQ4ANY", "ERROR BAD_COMMAND"),
			acq(pcA, " ACQ4ME k 1 1 0", "ERROR BAD_COMMAND"),
			acq(pcA, "ACQ4ANYk 1 1 0", "ERROR BAD_COMMAND"),
			acq(pcA, "STATS", "ERROR BAD_COMMAND"),
			acq(pcA, "STATSFULL", "ERROR BAD_COMMAND"),
			{c: pcA, send: "\n", raw: true, want: "ERROR BAD_COMMAND"},
			acq(pcA, "\r", "ERROR BAD_COMMAND"),
			acq(pcA, "release", "ERROR BAD_COMMAND"),
			acq(pcA, "RELEASE", "NOT_LOCKED"),
			acq(pcA, "RELEASE key", "NOT_LOCKED"),
			acq(pcA, "RELEASEXYZ", "NOT_LOCKED"),
			acq(pcA, "STATS total_acquired\r", "total_acquired: 0"),
			acq(pcA, "ACQ4ME k 1 1 0\r", "LOCKED"),
			acq(pcA, "RELEASE\r", "RELEASED"),
			acq(pcA, "STATS release_mismatch", "release_mismatch: 3"),
		}},
		{name: "syntax", steps: []pcStep{ // Requests: arguments: atou, strtok, opaque keys
			acq(pcA, "ACQ4ME ", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ME l", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ANY l", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ME l 0 1 1", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ANY l 1 0 1", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ME l GARBAGE 0 1", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ME l -1 1 1", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ME l 1.5 1 1", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ME l +1 1 1", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ME l 1 1x 1", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ME l 4294967296 1 1", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ME l 1 4294967296 0", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ME k\x00 1 1 0", "ERROR BAD_SYNTAX"),
			acq(pcA, "ACQ4ME l 4294967297 4294967297 0", "LOCKED"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "ACQ4ME l 1 1", "LOCKED"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "ACQ4ANY l 1 1 garbage", "LOCKED"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "ACQ4ME   l   01  001   0  extra tokens", "LOCKED"),
			acq(pcB, "ACQ4ME l 1 2 0", "TIMEOUT"),
			acq(pcB, "ACQ4ME a\tb 1 1 0", "LOCKED"),
			acq(pcC, "ACQ4ME a\tb 1 2 0", "TIMEOUT"),
			acq(pcC, "ACQ4ME a 1 1 0", "LOCKED"),
			acq(pcC, "ACQ4ME a%20b 1 1 0", "LOCKED"),
			acq(pcD, "ACQ4ME a%20b 1 2 0", "TIMEOUT"),
			acq(pcD, "STATS hashtable_entries", "hashtable_entries: 4"),
		}},
		{name: "limits-worked-example", steps: []pcStep{ // Acquire: per-request limits
			acq(pcA, "ACQ4ME k 2 3 5", "LOCKED"),
			acq(pcB, "ACQ4ME k 2 3 5", "LOCKED"),
			queued(pcC, "ACQ4ME k 2 3 5"),
			acq(pcD, "ACQ4ME k 2 3 5", "QUEUE_FULL"),
			queued(pcD, "ACQ4ME k 2 4 5"),
			acq(pcE, "ACQ4ME k 3 10 5", "LOCKED"),
			acq(pcA, "RELEASE", "RELEASED"),
			expect(pcC, "LOCKED"),
			acq(pcB, "RELEASE", "RELEASED"),
			expect(pcD, "LOCKED"),
			acq(pcE, "STATS processing_workers", "processing_workers: 3"),
			acq(pcE, "RELEASE", "RELEASED"),
			acq(pcC, "RELEASE", "RELEASED"),
			acq(pcD, "RELEASE", "RELEASED"),
		}},
		{name: "queue-checked-before-workers", steps: []pcStep{ // Acquire: the decision order
			acq(pcA, "ACQ4ME k 2 1 0", "LOCKED"),
			acq(pcB, "ACQ4ME k 2 1 0", "QUEUE_FULL"),
			acq(pcB, "ACQ4ANY k 2 2 0", "LOCKED"),
			acq(pcC, "ACQ4ME k 3 2 0", "QUEUE_FULL"),
			acq(pcC, "ACQ4ME k 3 3 0", "LOCKED"),
			acq(pcD, "ACQ4ME k 3 4 0", "TIMEOUT"),
			acq(pcD, "ACQ4ME k 3 4 1.5", "TIMEOUT"),
			acq(pcD, "ACQ4ME k 3 4 -1", "TIMEOUT"),
			acq(pcD, "STATS full_queues", "full_queues: 2"),
			acq(pcD, "STATS waiting_workers", "waiting_workers: 0"),
			acq(pcD, "STATS total_acquired", "total_acquired: 3"),
		}},
		{name: "me-waiters-fifo", steps: []pcStep{ // Release: FIFO, one slot one waiter
			acq(pcA, "ACQ4ME k 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ME k 1 10 5"),
			queued(pcC, "ACQ4ME k 1 10 5"),
			queued(pcD, "ACQ4ME k 1 10 5"),
			acq(pcA, "RELEASE", "RELEASED"),
			expect(pcB, "LOCKED"),
			acq(pcB, "RELEASE", "RELEASED"),
			expect(pcC, "LOCKED"),
			acq(pcC, "RELEASE", "RELEASED"),
			expect(pcD, "LOCKED"),
			acq(pcD, "RELEASE", "RELEASED"),
		}},
		{name: "any-waiters-done", steps: []pcStep{ // Release: DONE first, DONE consumes nothing
			acq(pcA, "ACQ4ME k 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ANY k 1 10 5"),
			queued(pcC, "ACQ4ANY k 1 10 5"),
			queued(pcD, "ACQ4ME k 1 10 5"),
			acq(pcA, "RELEASE", "RELEASED"),
			expect(pcB, "DONE"),
			expect(pcC, "DONE"),
			expect(pcD, "LOCKED"),
			acq(pcB, "RELEASE", "NOT_LOCKED"),
			acq(pcB, "ACQ4ME k 1 10 0", "TIMEOUT"),
			queued(pcB, "ACQ4ANY k 1 10 5"),
			acq(pcD, "RELEASE", "RELEASED"),
			expect(pcB, "DONE"),
			acq(pcB, "ACQ4ME k 1 10 5", "LOCKED"),
			acq(pcB, "STATS processing_workers", "processing_workers: 1"),
		}},
		{name: "done-while-others-hold", steps: []pcStep{ // Release: DONE although others still hold
			acq(pcA, "ACQ4ME k 2 10 5", "LOCKED"),
			acq(pcB, "ACQ4ME k 2 10 5", "LOCKED"),
			queued(pcC, "ACQ4ANY k 2 10 5"),
			acq(pcA, "RELEASE", "RELEASED"),
			expect(pcC, "DONE"),
			acq(pcC, "STATS processing_workers", "processing_workers: 1"),
			acq(pcB, "RELEASE", "RELEASED"),
		}},
		{name: "me-before-older-any", steps: []pcStep{ // Release: ME waiters before older ANY waiters
			acq(pcA, "ACQ4ANY k 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ANY k 1 10 5"),
			queued(pcC, "ACQ4ME k 1 10 5"),
			acq(pcA, "RELEASE", "RELEASED"),
			expect(pcB, "DONE"),
			expect(pcC, "LOCKED"),
			acq(pcC, "RELEASE", "RELEASED"),
		}},
		{name: "disconnect-hands-any-locked", steps: []pcStep{ // Disconnect: LOCKED, not DONE
			acq(pcA, "ACQ4ME k 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ANY k 1 10 5"),
			queued(pcC, "ACQ4ANY k 1 10 5"),
			{c: pcA, close: true},
			expect(pcB, "LOCKED"),
			acq(pcB, "RELEASE", "RELEASED"),
			expect(pcC, "DONE"),
		}},
		{name: "disconnect-prefers-me", steps: []pcStep{ // Disconnect: ME waiter first, then ANY
			acq(pcA, "ACQ4ME k 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ANY k 1 10 5"),
			queued(pcC, "ACQ4ME k 1 10 5"),
			{c: pcA, close: true},
			expect(pcC, "LOCKED"),
			acq(pcD, "STATS waiting_workers", "waiting_workers: 1"),
			acq(pcC, "RELEASE", "RELEASED"),
			expect(pcB, "DONE"),
		}},
		{name: "disconnect-while-waiting", steps: []pcStep{ // Disconnect: wait dropped, holds handed on
			acq(pcA, "ACQ4ME k 1 10 5", "LOCKED"),
			acq(pcB, "ACQ4ME j 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ME k 1 10 5"),
			queued(pcC, "ACQ4ME j 1 10 5"),
			{c: pcB, close: true},
			expect(pcC, "LOCKED"),
			acq(pcD, "STATS waiting_workers", "waiting_workers: 0"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcD, "ACQ4ME k 1 1 0", "LOCKED"),
			acq(pcD, "STATS processing_workers", "processing_workers: 2"),
		}},
		{name: "disconnect-frees-every-lock", steps: []pcStep{ // Disconnect: Thumbor's 3 locks
			acq(pcA, "ACQ4ME thumbor-ip 1 10 5", "LOCKED"),
			acq(pcA, "ACQ4ME thumbor-render 1 10 5", "LOCKED"),
			acq(pcA, "ACQ4ME thumbor-expensive 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ME thumbor-render 1 10 5"),
			queued(pcC, "ACQ4ME thumbor-expensive 1 10 5"),
			acq(pcA, "RELEASE", "RELEASED"),
			expect(pcC, "LOCKED"),
			{c: pcA, close: true},
			expect(pcB, "LOCKED"),
			acq(pcD, "ACQ4ME thumbor-ip 1 1 0", "LOCKED"),
			acq(pcD, "STATS processing_workers", "processing_workers: 3"),
		}},
		{name: "disconnect-then-reconnect", steps: []pcStep{ // upstream test_disconnect_*
			acq(pcA, "ACQ4ME l 1 10 1", "LOCKED"),
			{c: pcA, close: true, until: "processing_workers: 0"},
			acq(pcA, "ACQ4ME l 1 10 10", "LOCKED"),
			queued(pcB, "ACQ4ANY l 1 10 10"),
			{c: pcB, close: true, until: "waiting_workers: 0"},
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "STATS hashtable_entries", "hashtable_entries: 0"),
		}},
		{name: "half-close", steps: []pcStep{ // Disconnect: a half-close counts
			acq(pcA, "ACQ4ME k 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ME k 1 10 5"),
			{c: pcA, halfClose: true},
			expect(pcB, "LOCKED"),
			queued(pcC, "ACQ4ME k 1 10 5"),
			{c: pcC, halfClose: true, until: "waiting_workers: 0"},
			acq(pcB, "RELEASE", "RELEASED"),
			acq(pcD, "ACQ4ME d 1 1 0", "LOCKED"),
			{c: pcD, send: "RELEASE", halfClose: true, want: "RELEASED"},
			acq(pcE, "STATS hashtable_entries", "hashtable_entries: 0"),
		}},
		{name: "four-slots-lifo", steps: []pcStep{ // Slots per connection: LOCK_HELD, LIFO RELEASE
			acq(pcA, "ACQ4ME k1 1 2 0", "LOCKED"),
			acq(pcA, "ACQ4ME k2 1 2 0", "LOCKED"),
			acq(pcA, "ACQ4ANY k3 1 2 0", "LOCKED"),
			acq(pcA, "ACQ4ME k4 1 2 0", "LOCKED"),
			acq(pcA, "ACQ4ME k5 1 2 0", "LOCK_HELD"),
			acq(pcA, "ACQ4ANY k5 1 2 0", "LOCK_HELD"),
			acq(pcA, "ACQ4ME bad", "LOCK_HELD"),
			acq(pcB, "ACQ4ME k4 1 2 0", "TIMEOUT"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcB, "ACQ4ME k4 1 2 0", "LOCKED"),
			acq(pcB, "ACQ4ME k3 1 2 0", "TIMEOUT"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcB, "ACQ4ME k3 1 2 0", "LOCKED"),
			acq(pcB, "ACQ4ME k1 1 2 0", "TIMEOUT"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "RELEASE", "NOT_LOCKED"),
			acq(pcB, "ACQ4ME k1 1 2 0", "LOCKED"),
			acq(pcB, "STATS lock_mismatch", "lock_mismatch: 3"),
		}},
		{name: "wait-for-response", steps: []pcStep{ // Acquire: WAIT_FOR_RESPONSE and the check order
			acq(pcA, "ACQ4ME k 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ME k 1 10 5"),
			acq(pcB, "ACQ4ME other 1 10 5", "ERROR WAIT_FOR_RESPONSE"),
			acq(pcB, "ACQ4ME bad", "ERROR WAIT_FOR_RESPONSE"),
			acq(pcB, "ACQ4ANY other 1 1 0", "ERROR WAIT_FOR_RESPONSE"),
			acq(pcA, "RELEASE", "RELEASED"),
			expect(pcB, "LOCKED"),
			acq(pcB, "ACQ4ME other 1 10 0", "LOCKED"),
			acq(pcC, "ACQ4ME c1 1 10 0", "LOCKED"),
			acq(pcC, "ACQ4ME c2 1 10 0", "LOCKED"),
			acq(pcC, "ACQ4ME c3 1 10 0", "LOCKED"),
			queued(pcC, "ACQ4ME k 1 10 5"),
			acq(pcC, "ACQ4ME x 1 1 0", "LOCK_HELD"),
			acq(pcB, "RELEASE", "RELEASED"),
			acq(pcB, "RELEASE", "RELEASED"),
			expect(pcC, "LOCKED"),
			acq(pcC, "STATS lock_while_waiting", "lock_while_waiting: 3"),
			acq(pcC, "STATS lock_mismatch", "lock_mismatch: 1"),
		}},
		{name: "same-key-twice", steps: []pcStep{ // upstream test_same_lock_twice*, E9
			acq(pcA, "ACQ4ME l 2 2 1", "LOCKED"),
			acq(pcA, "ACQ4ME l 2 2 1", "LOCKED"),
			acq(pcB, "ACQ4ME l 2 2 0", "QUEUE_FULL"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "ACQ4ANY m 1 2 1", "LOCKED"),
			{c: pcA, send: "ACQ4ANY m 1 2 1", want: "TIMEOUT", slow: true},
			acq(pcA, "ACQ4ANY m 1 2 0", "TIMEOUT"),
			acq(pcA, "ACQ4ME m 1 1 1", "QUEUE_FULL"),
			acq(pcA, "ACQ4ME m 1 2 0", "TIMEOUT"),
			acq(pcA, "ACQ4ME m 1 2 0", "TIMEOUT"),
			acq(pcA, "ACQ4ME m 1 2 0", "TIMEOUT"),
			acq(pcA, "ACQ4ME m 1 2 0", "TIMEOUT"),
			acq(pcA, "ACQ4ME n 1 1 0", "LOCKED"),
			acq(pcA, "ACQ4ME o 1 1 0", "LOCKED"),
			acq(pcA, "ACQ4ME p 1 1 0", "LOCKED"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "RELEASE", "RELEASED"),
			acq(pcA, "RELEASE", "NOT_LOCKED"),
		}},
		{name: "timeouts", steps: []pcStep{ // Waiters and timeouts
			acq(pcA, "ACQ4ME k 1 10 5", "LOCKED"),
			acq(pcD, "ACQ4ME d 1 10 0", "LOCKED"),
			queued(pcB, "ACQ4ME k 1 10 1"),
			queued(pcC, "ACQ4ANY k 1 10 1"),
			queued(pcD, "ACQ4ME k 1 10 1"),
			{c: pcB, want: "TIMEOUT", slow: true},
			{c: pcC, want: "TIMEOUT", slow: true},
			{c: pcD, want: "TIMEOUT", slow: true},
			acq(pcB, "RELEASE", "NOT_LOCKED"),
			acq(pcE, "STATS waiting_workers", "waiting_workers: 0"),
			acq(pcE, "ACQ4ME d 1 10 0", "TIMEOUT"),
			acq(pcD, "RELEASE", "RELEASED"),
			acq(pcE, "ACQ4ME d 1 10 0", "LOCKED"),
			// No late TIMEOUT after a handoff (upstream test_no_timeout_after_initial_delay).
			queued(pcB, "ACQ4ME k 1 10 1"),
			acq(pcA, "RELEASE", "RELEASED"),
			expect(pcB, "LOCKED"),
			{c: pcB, silent: 1500 * time.Millisecond},
			acq(pcB, "RELEASE", "RELEASED"),
		}},
		{name: "stats-items", steps: []pcStep{ // Statistics: STATS items
			{c: pcA, send: "STATS UPTIME", re: `uptime: \d+ days, \d+h \d+m \d+s\n`},
			{c: pcA, send: "STATS uptime", re: `uptime: \d+ days, \d+h \d+m \d+s\n`},
			{c: pcA, send: "STATS FULL", re: pcFullRE(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), full: true},
			{c: pcA, send: "STATS full", re: pcFullRE(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), full: true},
			acq(pcA, "STATS TOTAL_ACQUIRED", "total_acquired: 0"),
			acq(pcA, "STATS Total_Releases", "total_releases: 0"),
			acq(pcA, "STATS hashtable_entries", "hashtable_entries: 0"),
			acq(pcA, "STATS processing_workers", "processing_workers: 0"),
			acq(pcA, "STATS waiting_workers", "waiting_workers: 0"),
			acq(pcA, "STATS connect_errors", "connect_errors: 0"),
			acq(pcA, "STATS failed_sends", "failed_sends: 0"),
			acq(pcA, "STATS full_queues", "full_queues: 0"),
			acq(pcA, "STATS lock_mismatch", "lock_mismatch: 0"),
			acq(pcA, "STATS lock_while_waiting", "lock_while_waiting: 0"),
			acq(pcA, "STATS release_mismatch", "release_mismatch: 0"),
			acq(pcA, "STATS processed_count", "processed_count: 0"),
		}},
		{name: "stats-counters", steps: []pcStep{ // Statistics: what moves each counter
			acq(pcA, "ACQ4ME k 1 2 5", "LOCKED"),
			acq(pcB, "ACQ4ME k 1 1 0", "QUEUE_FULL"),
			acq(pcB, "ACQ4ME k 1 2 0", "TIMEOUT"),
			acq(pcB, "ACQ4ME k", "ERROR BAD_SYNTAX"),
			queued(pcB, "ACQ4ANY k 1 2 5"),
			acq(pcB, "ACQ4ME x 1 1 0", "ERROR WAIT_FOR_RESPONSE"),
			acq(pcC, "RELEASE", "NOT_LOCKED"),
			acq(pcC, "ACQ4ME c1 1 1 0", "LOCKED"),
			acq(pcC, "ACQ4ME c2 1 1 0", "LOCKED"),
			acq(pcC, "ACQ4ME c3 1 1 0", "LOCKED"),
			acq(pcC, "ACQ4ME c4 1 1 0", "LOCKED"),
			acq(pcC, "ACQ4ME c5 1 1 0", "LOCK_HELD"),
			{c: pcD, send: "STATS FULL", re: pcFullRE(5, 0, 5, 5, 1, 0, 0, 1, 1, 1, 1, 0), full: true},
			acq(pcA, "RELEASE", "RELEASED"),
			expect(pcB, "DONE"),
			{c: pcC, close: true, until: "processing_workers: 0"},
			{c: pcD, send: "STATS FULL", re: pcFullRE(5, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 5), full: true},
		}},

		// Section 16 defects, fixed: each side's replies are given.
		{name: "pipelined-commands", deviation: "pipelined commands are all answered, in order (1.1.3 answers the first of a segment and drops the rest)", steps: []pcStep{
			{c: pcA, send: "STATS total_acquired\nSTATS total_releases\n", raw: true, wantRaw: "total_acquired: 0\ntotal_releases: 0\n", only: "ours"},
			{c: pcA, send: "STATS total_acquired\nSTATS total_releases\n", raw: true, want: "total_acquired: 0", only: "ref"},
			acq(pcA, "STATS processed_count", "processed_count: 0"),
			{c: pcA, send: "ACQ4ME p 1 1 0\nRELEASE\n", raw: true, wantRaw: "LOCKED\nRELEASED\n", only: "ours"},
			{c: pcA, send: "ACQ4ME p 1 1 0\nRELEASE\n", raw: true, want: "LOCKED", only: "ref"},
			{c: pcA, send: "STATS processing_workers", want: "processing_workers: 0", only: "ours"},
			{c: pcA, send: "STATS processing_workers", want: "processing_workers: 1", only: "ref"},
		}},
		{name: "split-line", deviation: "a line split across segments is joined (1.1.3 drops the first part)", steps: []pcStep{
			{c: pcA, send: "ACQ4", raw: true, sync: true},
			{c: pcA, send: "ME k 1 1 0\n", raw: true, want: "LOCKED", only: "ours"},
			{c: pcA, send: "ME k 1 1 0\n", raw: true, want: "ERROR BAD_COMMAND", only: "ref"},
			{c: pcA, send: "ST", raw: true, sync: true},
			{c: pcA, send: "ATS hash", raw: true, sync: true},
			{c: pcA, send: "table_entries\r\n", raw: true, want: "hashtable_entries: 1", only: "ours"},
			{c: pcA, send: "table_entries\r\n", raw: true, want: "ERROR BAD_COMMAND", only: "ref"},
		}},
		{name: "long-lines", deviation: "a line over 1023 bytes gets ERROR LINE_TOO_LONG and is skipped to its newline (1.1.3 drops 1024-byte chunks and parses the tail)", steps: []pcStep{
			acq(pcA, long1023, "LOCKED"),
			acq(pcA, "RELEASE", "RELEASED"),
			{c: pcA, send: long1024, want: "ERROR LINE_TOO_LONG", only: "ours"},
			{c: pcA, send: long1024, want: "ERROR BAD_COMMAND", only: "ref"},
			{c: pcA, send: long5000, want: "ERROR LINE_TOO_LONG", only: "ours"},
			{c: pcA, send: long5000, want: "ERROR BAD_COMMAND", only: "ref"},
			{c: pcA, send: strings.Repeat("y", 1<<20), want: "ERROR LINE_TOO_LONG", only: "ours"},
			acq(pcA, "STATS total_acquired", "total_acquired: 1"),
		}},
		{name: "wrong-stat-newline", deviation: "ERROR WRONG_STAT ends with a newline (1.1.3 sends none, a line-reading client hangs)", steps: []pcStep{
			{c: pcA, send: "STATS nonsense", want: "ERROR WRONG_STAT", only: "ours"},
			{c: pcA, send: "STATS nonsense", wantRaw: "ERROR WRONG_STAT", only: "ref"},
			{c: pcA, send: "STATS  FULL", want: "ERROR WRONG_STAT", only: "ours"},
			{c: pcA, send: "STATS  FULL", wantRaw: "ERROR WRONG_STAT", only: "ref"},
			{c: pcA, send: "STATS FULL x", want: "ERROR WRONG_STAT", only: "ours"},
			{c: pcA, send: "STATS FULL x", wantRaw: "ERROR WRONG_STAT", only: "ref"},
			{c: pcA, send: "STATS ", want: "ERROR WRONG_STAT", only: "ours"},
			{c: pcA, send: "STATS ", wantRaw: "ERROR WRONG_STAT", only: "ref"},
			acq(pcA, "STATS total_acquired", "total_acquired: 0"),
		}},
		{name: "stray-bytes-keep-timeout", deviation: "bytes sent by a waiting client do not cancel its timeout (1.1.3 then waits forever)", steps: []pcStep{
			acq(pcA, "ACQ4ME k 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ME k 1 10 1"),
			acq(pcB, "STATS total_acquired", "total_acquired: 1"),
			{c: pcB, want: "TIMEOUT", slow: true, only: "ours"},
			{c: pcB, silent: 2 * time.Second, only: "ref"},
			acq(pcA, "RELEASE", "RELEASED"),
			{c: pcB, want: "LOCKED", only: "ref"},
			{c: pcB, send: "RELEASE", want: "NOT_LOCKED", only: "ours"},
			{c: pcB, send: "RELEASE", want: "RELEASED", only: "ref"},
		}},
		{name: "release-while-waiting", deviation: "RELEASE while waiting only cancels that wait (1.1.3 also sends DONE to every ACQ4ANY waiter and leaks waiting_workers)", refDrift: true, steps: []pcStep{
			acq(pcA, "ACQ4ME k 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ME k 1 10 5"),
			queued(pcC, "ACQ4ANY k 1 10 5"),
			acq(pcB, "RELEASE", "RELEASED"),
			{c: pcC, want: "DONE", only: "ref"},
			acq(pcB, "ACQ4ME z 1 1 0", "LOCKED"),
			// Equal by chance: ours counts C still waiting, the reference counts B's leaked wait
			// (C's was decremented by the bogus DONE).
			acq(pcD, "STATS waiting_workers", "waiting_workers: 1"),
			acq(pcA, "RELEASE", "RELEASED"),
			{c: pcC, want: "DONE", only: "ours"},
			{c: pcD, send: "STATS waiting_workers", want: "waiting_workers: 0", only: "ours"},
			{c: pcD, send: "STATS waiting_workers", want: "waiting_workers: 1", only: "ref"},
		}},
		{name: "stats-key", deviation: "new STATS KEY <key> item for one key's introspection (1.1.3: ERROR WRONG_STAT)", steps: []pcStep{
			acq(pcA, "ACQ4ME k 1 10 5", "LOCKED"),
			queued(pcB, "ACQ4ANY k 1 10 5"),
			{c: pcC, send: "STATS KEY k", re: `key=k holders=1 waiting_for_me=0 waiting_for_anyone=1 longest_hold=\d+\.\d{6}s longest_wait=\d+\.\d{6}s oldest_holder=127\.0\.0\.1:\d+\n`, only: "ours"},
			{c: pcC, send: "STATS key nokey", want: "key=nokey holders=0 waiting_for_me=0 waiting_for_anyone=0 longest_hold=0.000000s longest_wait=0.000000s oldest_holder=-", only: "ours"},
			{c: pcC, send: "STATS KEY", want: "ERROR BAD_SYNTAX", only: "ours"},
			{c: pcC, send: "STATS KEY k", wantRaw: "ERROR WRONG_STAT", only: "ref"},
			acq(pcA, "RELEASE", "RELEASED"),
			expect(pcB, "DONE"),
		}},
	}
}

// ---------------------------------------------------------------------------------------------
// Transcript runner

const pcReplyDeadline = 5 * time.Second

type pcClient struct {
	conn net.Conn
	r    *bufio.Reader
}

type pcRun struct {
	t        *testing.T
	side     string // "ours" or "ref"
	addr     string
	clients  map[int]*pcClient
	observer *pcClient
}

func (r *pcRun) dial() *pcClient {
	r.t.Helper()
	conn, err := net.DialTimeout("tcp", r.addr, pcReplyDeadline)
	if err != nil {
		r.t.Fatalf("%s: dial %s: %v", r.side, r.addr, err)
	}
	return &pcClient{conn: conn, r: bufio.NewReader(conn)}
}

func (r *pcRun) client(i int) *pcClient {
	c := r.clients[i]
	if c == nil {
		c = r.dial()
		r.clients[i] = c
	}
	return c
}

func (r *pcRun) write(c *pcClient, b string) {
	r.t.Helper()
	if err := c.conn.SetWriteDeadline(time.Now().Add(pcReplyDeadline)); err != nil {
		r.t.Fatalf("%s: set deadline: %v", r.side, err)
	}
	if _, err := io.WriteString(c.conn, b); err != nil {
		r.t.Fatalf("%s: write %q: %v", r.side, b, err)
	}
}

// readN reads exactly n bytes, or returns what arrived before the deadline with the error.
func (c *pcClient) readN(n int, d time.Duration) (string, error) {
	c.conn.SetReadDeadline(time.Now().Add(d)) //nolint:errcheck // a failed set shows up as a read error
	buf := make([]byte, n)
	got, err := io.ReadFull(c.r, buf)
	return string(buf[:got]), err
}

func (c *pcClient) readLine(d time.Duration) (string, error) {
	c.conn.SetReadDeadline(time.Now().Add(d)) //nolint:errcheck // a failed set shows up as a read error
	return c.r.ReadString('\n')
}

// stat asks the observer for one counter and returns the whole reply line.
func (r *pcRun) stat(name string) string {
	r.t.Helper()
	r.write(r.observer, "STATS "+name+"\n")
	line, err := r.observer.readLine(pcReplyDeadline)
	if err != nil {
		r.t.Fatalf("%s: observer STATS %s: %q, %v", r.side, name, line, err)
	}
	return strings.TrimSuffix(line, "\n")
}

func (r *pcRun) statInt(name string) int {
	r.t.Helper()
	line := r.stat(name)
	v, err := strconv.Atoi(strings.TrimPrefix(line, name+": "))
	if err != nil {
		r.t.Fatalf("%s: observer STATS %s: bad reply %q", r.side, name, line)
	}
	return v
}

// waitStat polls the observer until "STATS <name>" answers want (a condition, not a sleep:
// each poll is a round trip through the server's event loop).
func (r *pcRun) waitStat(want string) {
	r.t.Helper()
	name, _, _ := strings.Cut(want, ":")
	deadline := time.Now().Add(pcReplyDeadline)
	for {
		got := r.stat(name)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("%s: observer STATS %s: still %q, want %q", r.side, name, got, want)
		}
	}
}

// run plays one transcript and returns the reply observed at each step ("" for steps of the
// other side or without a reply), for the side-by-side comparison.
func (r *pcRun) run(tr pcTranscript) []string {
	t := r.t
	t.Helper()
	r.clients = map[int]*pcClient{}
	r.observer = r.dial()
	defer func() {
		for _, c := range r.clients {
			c.conn.Close()
		}
		r.observer.conn.Close()
	}()
	replies := make([]string, len(tr.steps))
	lastSend := map[int]time.Time{}
	for i, st := range tr.steps {
		if st.only != "" && st.only != r.side {
			continue
		}
		where := fmt.Sprintf("%s step %d (client %c", r.side, i, 'A'+st.c)
		if st.send != "" {
			where += fmt.Sprintf(" sends %.60q", st.send)
		}
		where += ")"
		c := r.client(st.c)
		var waiting int
		if st.queued {
			waiting = r.statInt("waiting_workers")
		}
		if st.send != "" || st.raw {
			line := st.send
			if !st.raw {
				line += "\n"
			}
			r.write(c, line)
			lastSend[st.c] = time.Now()
		}
		if st.halfClose {
			if err := c.conn.(*net.TCPConn).CloseWrite(); err != nil {
				t.Fatalf("%s: half-close: %v", where, err)
			}
		}
		if st.queued {
			r.waitStat(fmt.Sprintf("waiting_workers: %d", waiting+1))
		}
		deadline := pcReplyDeadline
		if st.slow {
			deadline = 3 * time.Second
		}
		switch {
		case st.want != "" || st.wantRaw != "":
			want := st.wantRaw
			if st.want != "" {
				want = st.want + "\n"
			}
			got, err := c.readN(len(want), deadline)
			replies[i] = got
			if got != want {
				t.Errorf("%s: got %q (%v), want %q", where, got, err, want)
			}
			if el := time.Since(lastSend[st.c]); st.slow && el < 500*time.Millisecond {
				t.Errorf("%s: %q came %v after the client's last request, before its 1 s timeout", where, got, el)
			}
		case st.re != "":
			var got string
			for {
				line, err := c.readLine(deadline)
				got += line
				if err != nil {
					t.Errorf("%s: reading reply: %q, %v", where, got, err)
					break
				}
				if !st.full || line == "\n" {
					break
				}
			}
			replies[i] = pcNormalize(got)
			if !regexp.MustCompile(`\A` + st.re + `\z`).MatchString(got) {
				t.Errorf("%s: got %q, want match for %q", where, got, st.re)
			}
		}
		if st.silent > 0 {
			got, err := c.readN(1, st.silent)
			if !pcIsTimeout(err) {
				t.Errorf("%s: got %q (%v), want nothing for %v", where, got, err, st.silent)
			}
		}
		if st.halfClose {
			got, err := c.readN(1, pcReplyDeadline)
			if !errors.Is(err, io.EOF) {
				t.Errorf("%s: after half-close got %q (%v), want EOF", where, got, err)
			}
			c.conn.Close()
			delete(r.clients, st.c)
		}
		if st.close {
			c.conn.Close()
			delete(r.clients, st.c)
		}
		if st.until != "" {
			r.waitStat(st.until)
		}
		if st.sync {
			r.stat("total_acquired")
			r.stat("total_acquired")
		}
		if t.Failed() {
			return replies
		}
	}
	// Nothing unexpected is left unread: the next reply on every open client is the one to a
	// fresh request.
	for i, c := range r.clients {
		r.write(c, "STATS UPTIME\n")
		line, err := c.readLine(pcReplyDeadline)
		if !strings.HasPrefix(line, "uptime: ") {
			t.Errorf("%s: client %c: unread reply before the final check: %q (%v)", r.side, 'A'+i, line, err)
		}
		c.conn.Close()
		delete(r.clients, i)
	}
	// Everything is freed once every client is gone.
	r.waitStat("processing_workers: 0")
	r.waitStat("hashtable_entries: 0")
	if !(tr.refDrift && r.side == "ref") {
		r.waitStat("waiting_workers: 0")
	}
	return replies
}

var (
	pcUptimeRE = regexp.MustCompile(`uptime: \d+ days, \d+h \d+m \d+s`)
	pcDurRE    = regexp.MustCompile(pcDur)
)

// pcNormalize blanks what legitimately differs between two runs (clocks), keeping counters.
func pcNormalize(s string) string {
	s = pcUptimeRE.ReplaceAllString(s, "uptime: ...")
	return pcDurRE.ReplaceAllString(s, "...s")
}

// ---------------------------------------------------------------------------------------------
// Servers under test

func pcTestLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(pcTestLogWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type pcTestLogWriter struct{ t *testing.T }

func (w pcTestLogWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// startOurs runs a lockServer on 127.0.0.1:0 until the test ends; cleanup checks that Serve
// returned nil, that the table is consistent and that no connection goroutine is left.
func startOurs(t *testing.T) (*lockServer, string) {
	t.Helper()
	s := newLockServer(pcTestLogger(t))
	ln, err := listenPoolCounter("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Serve returned %v, want nil", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("Serve did not return 10 s after cancel")
		}
		if err := s.checkInvariants(); err != nil {
			t.Error(err)
		}
	})
	return s, ln.Addr().String()
}

// pcReferencePath finds Debian's poolcounterd.
func pcReferencePath(t *testing.T) string {
	t.Helper()
	return referenceTool(t, "POOLCOUNTERD", "poolcounterd", "the comparison with the reference server",
		"apt-get install -y poolcounter", "/usr/bin/poolcounterd")
}

// startReference runs poolcounterd on a fresh 127.0.0.1:0 listener handed over as fd 0 (it
// binds only port 7531 otherwise), so each transcript gets fresh statistics.
func startReference(t *testing.T, path string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f, err := ln.(*net.TCPListener).File()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd := exec.Command(path)
	cmd.Stdin = f
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", path, err)
	}
	// The child has its own copy of the listening socket; connections queue on it.
	f.Close()
	addr := ln.Addr().String()
	ln.Close()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM) //nolint:errcheck // Wait reports how it ended
		err := cmd.Wait()
		if err != nil {
			t.Errorf("poolcounterd: %v; stderr: %s", err, stderr.String())
		}
	})
	return addr
}

// ---------------------------------------------------------------------------------------------
// The transcript tests

// TestPoolCounterTranscripts plays every transcript against our server.
func TestPoolCounterTranscripts(t *testing.T) {
	for _, tr := range pcTranscripts() {
		t.Run(tr.name, func(t *testing.T) {
			t.Parallel()
			_, addr := startOurs(t)
			(&pcRun{t: t, side: "ours", addr: addr}).run(tr)
		})
	}
}

// TestPoolCounterReference plays every transcript against Debian's poolcounterd and against
// our server, and compares the replies step by step: they must be identical except in the
// steps of a documented deviation.
func TestPoolCounterReference(t *testing.T) {
	path := pcReferencePath(t)
	var mu sync.Mutex
	compared, deviations := 0, 0
	t.Run("group", func(t *testing.T) {
		for _, tr := range pcTranscripts() {
			t.Run(tr.name, func(t *testing.T) {
				t.Parallel()
				ref := (&pcRun{t: t, side: "ref", addr: startReference(t, path)}).run(tr)
				if t.Failed() {
					return
				}
				_, addr := startOurs(t)
				ours := (&pcRun{t: t, side: "ours", addr: addr}).run(tr)
				n := 0
				for i, st := range tr.steps {
					if st.only != "" {
						continue
					}
					n++
					if ours[i] != ref[i] {
						t.Errorf("step %d (client %c sends %.60q): ours %q, poolcounterd %q", i, 'A'+st.c, st.send, ours[i], ref[i])
					}
				}
				mu.Lock()
				compared += n
				if tr.deviation != "" {
					deviations++
					t.Logf("documented deviation: %s", tr.deviation)
				}
				mu.Unlock()
			})
		}
	})
	t.Logf("compared %d steps of %d transcripts with %s; %d transcripts show documented deviations",
		compared, len(pcTranscripts()), path, deviations)
	if compared == 0 && !t.Failed() {
		t.Fatal("no step was compared")
	}
}
