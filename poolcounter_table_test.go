// poolcounter_table_test.go: tests of the lock table (poolcounter_table.go): the invariant
// check every other test ends with, a connection without a socket for driving the table
// directly, and the stress test of mutual exclusion under random concurrent requests.

package main

import (
	"bufio"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// checkInvariants recounts the table and compares it with the gauges (test-only).
func (s *lockServer) checkInvariants() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var holders, waiters int64
	for name, k := range s.keys {
		if k.name != name || k.count() == 0 {
			return fmt.Errorf("key %q: name %q, count %d", name, k.name, k.count())
		}
		for _, l := range []struct {
			list  *lockSlotList
			state lockSlotState
		}{{&k.holders, slotHeld}, {&k.waitMe, slotWaitMe}, {&k.waitAny, slotWaitAny}} {
			n := 0
			for sl := l.list.head; sl != nil; sl = sl.next {
				n++
				if sl.key != k || sl.state != l.state {
					return fmt.Errorf("key %q: slot in wrong list (state %d)", name, sl.state)
				}
				idx := -1
				for i := 0; i < sl.conn.n; i++ {
					if &sl.conn.slots[i] == sl {
						idx = i
					}
				}
				if idx < 0 || (sl.state != slotHeld && idx != sl.conn.n-1) {
					return fmt.Errorf("key %q: slot %d not on its connection's stack top (n=%d)", name, idx, sl.conn.n)
				}
				if (sl.state == slotHeld) != (sl.heapIdx < 0) {
					return fmt.Errorf("key %q: slot state %d heap index %d", name, sl.state, sl.heapIdx)
				}
			}
			if n != l.list.n {
				return fmt.Errorf("key %q: list length %d, counted %d", name, l.list.n, n)
			}
		}
		holders += int64(k.holders.n)
		waiters += int64(k.waitMe.n + k.waitAny.n)
	}
	st := s.stats
	if st.hashtableEntries != int64(len(s.keys)) || st.processingWorkers != holders ||
		st.waitingWorkers != waiters || int64(len(s.waiters)) != waiters {
		return fmt.Errorf("gauges keys=%d holders=%d waiters=%d heap=%d, table has %d keys %d holders %d waiters",
			st.hashtableEntries, st.processingWorkers, st.waitingWorkers, len(s.waiters), len(s.keys), holders, waiters)
	}
	for i, sl := range s.waiters {
		if sl.heapIdx != i {
			return fmt.Errorf("heap index %d stored as %d", i, sl.heapIdx)
		}
	}
	return nil
}

// pcFakeConn is a lockConn without a socket, for driving the table directly.
func pcFakeConn(s *lockServer, name string) *lockConn {
	a, b := net.Pipe()
	go io.Copy(io.Discard, b) //nolint:errcheck // drains replies; ends when a is closed
	c := &lockConn{s: s, nc: a, remote: name}
	for i := range c.slots {
		c.slots[i].conn = c
		c.slots[i].heapIdx = -1
	}
	return c
}

// TestPoolCounterStress: many clients run random requests on a few keys at once. Every
// request gets exactly one reply, each client's replies follow its own lock stack (LOCK_HELD
// at 4, NOT_LOCKED when empty), "mutex" never has two holders, and everything is freed at the
// end. Run it under -race.
func TestPoolCounterStress(t *testing.T) {
	s, addr := startOurs(t)
	const clients, ops = 24, 250
	var mutexHolders atomic.Int32 // clients that believe they hold "mutex"
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := 0; i < clients; i++ {
		wg.Add(1)
		go func(seed uint64) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, 42))
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				errs <- err
				return
			}
			defer conn.Close()
			r := bufio.NewReader(conn)
			var stack []string // keys held, newest last
			for op := 0; op < ops; op++ {
				var line string
				key := []string{"mutex", "a", "b"}[rng.IntN(3)]
				release := len(stack) > 0 && rng.IntN(2) == 0
				switch {
				case release:
					line = "RELEASE"
					if stack[len(stack)-1] == "mutex" {
						mutexHolders.Add(-1) // before the server can hand it on
					}
				case rng.IntN(10) == 0:
					line = "STATS " + []string{"FULL", "UPTIME", "waiting_workers", "KEY mutex"}[rng.IntN(4)]
				default:
					verb := []string{"ACQ4ME", "ACQ4ANY"}[rng.IntN(2)]
					workers := 1
					if key != "mutex" {
						workers = 1 + rng.IntN(2)
					}
					// Rarely wait: a client waiting while it holds other keys can deadlock
					// with another until both time out.
					timeout := 0
					if rng.IntN(12) == 0 {
						timeout = 1
					}
					line = fmt.Sprintf("%s %s %d %d %d", verb, key, workers, 1+rng.IntN(30), timeout)
				}
				conn.SetDeadline(time.Now().Add(10 * time.Second)) //nolint:errcheck // the read fails if not applied
				if _, err := io.WriteString(conn, line+"\n"); err != nil {
					errs <- err
					return
				}
				reply, err := r.ReadString('\n')
				if err != nil {
					errs <- fmt.Errorf("%q: %w", line, err)
					return
				}
				if strings.HasPrefix(line, "STATS FULL") {
					for reply != "\n" {
						if reply, err = r.ReadString('\n'); err != nil {
							errs <- err
							return
						}
					}
					continue
				}
				want := ""
				switch {
				case release:
					want = "RELEASED\n"
					stack = stack[:len(stack)-1]
				case strings.HasPrefix(line, "ACQ") && len(stack) == poolCounterSlotsPerConn:
					want = "LOCK_HELD\n"
				case strings.HasPrefix(line, "ACQ"):
					switch reply {
					case "LOCKED\n":
						stack = append(stack, key)
						if key == "mutex" && mutexHolders.Add(1) > 1 {
							errs <- fmt.Errorf("two holders of mutex")
							return
						}
					case "TIMEOUT\n", "QUEUE_FULL\n", "DONE\n":
					default:
						errs <- fmt.Errorf("%q: reply %q", line, reply)
						return
					}
				}
				if want != "" && reply != want {
					errs <- fmt.Errorf("%q with %d held: got %q, want %q", line, len(stack), reply, want)
					return
				}
			}
			for _, k := range stack {
				if k == "mutex" {
					mutexHolders.Add(-1)
				}
			}
		}(uint64(i))
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Every client has closed: wait until the server has freed everything.
	deadline := time.Now().Add(pcReplyDeadline)
	for {
		s.mu.Lock()
		n, conns := len(s.keys), len(s.conns)
		s.mu.Unlock()
		if n == 0 && conns == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d keys and %d connections left", n, conns)
		}
		runtime.Gosched()
	}
	if err := s.checkInvariants(); err != nil {
		t.Error(err)
	}
}
