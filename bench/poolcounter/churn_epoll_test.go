// churn_epoll_test.go: the epoll churn client against a minimal in-process server (every
// cycle counted, each phase timed) and against servers that fail at each step (the error
// names the step).

package main

import (
	"bufio"
	"net"
	"strings"
	"testing"
	"time"
)

// lockStub answers like the floor server, or with reply instead of LOCKED when it is set; it
// stops when the test ends.
func lockStub(t *testing.T, reply string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					out := "RELEASED\n"
					if strings.HasPrefix(line, "ACQ4ME ") {
						out = "LOCKED\n"
						if reply != "" {
							out = reply
						}
					}
					if _, err := c.Write([]byte(out)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

func TestChurnEpoll(t *testing.T) {
	addr := lockStub(t, "")
	for _, sources := range []int{1, 4} {
		r, err := measureChurnEpoll(addr, 16, 200*time.Millisecond, 1_000_000, sources)
		if err != nil {
			t.Fatalf("sources %d: %v", sources, err)
		}
		if r.cycles == 0 || r.errors != 0 {
			t.Fatalf("sources %d: %d cycles, %d errors", sources, r.cycles, r.errors)
		}
		for name, l := range map[string][]time.Duration{"connect": r.connect, "acq": r.acq, "release": r.release, "ends": r.ends} {
			if int64(len(l)) != r.cycles {
				t.Errorf("sources %d: %d %s times for %d cycles", sources, len(l), name, r.cycles)
			}
		}
		if r.pct(100) <= 0 || r.pct(100) > 10*time.Second {
			t.Errorf("sources %d: max latency %v", sources, r.pct(100))
		}
	}
	// The cycle budget is kept exactly.
	r, err := measureChurnEpoll(addr, 16, 10*time.Second, 100, 1)
	if err != nil || r.cycles != 100 {
		t.Errorf("budget 100: %d cycles, %v", r.cycles, err)
	}
}

func TestChurnEpollErrors(t *testing.T) {
	// A port nobody listens on: the connect fails.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	for _, tc := range []struct{ addr, want string }{
		{closed, "connect: connection refused"},
		{lockStub(t, "QUEUE_FULL\n"), `ACQ4ME: got "QUEUE_FULL\n", want "LOCKED\n"`},
		{lockStub(t, "LOCKED\nLOCKED\n"), `ACQ4ME: got "LOCKED\nLOCKED\n"`},
	} {
		_, err := measureChurnEpoll(tc.addr, 4, time.Second, 1000, 1)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want it to contain %q", tc.addr, err, tc.want)
		}
	}
}
