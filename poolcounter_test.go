// poolcounter_test.go: tests of the server (poolcounter.go): shutdown, accept back-off, and
// the listening socket's options. The protocol's behaviour is tested by the transcripts
// (poolcounter_transcript_test.go); each other poolcounter_*.go has its tests beside it.

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
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestPoolCounterShutdown: cancelling ctx closes every connection (holders and waiters) and
// Serve returns nil after its goroutines are gone.
func TestPoolCounterShutdown(t *testing.T) {
	s := newLockServer(pcTestLogger(t))
	ln, err := listenPoolCounter("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, ln) }()
	var conns []*pcClient
	for i, line := range []string{"ACQ4ME k 1 10 60", "ACQ4ME k 1 10 60", "STATS waiting_workers"} {
		conn, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		c := &pcClient{conn: conn, r: bufio.NewReader(conn)}
		conns = append(conns, c)
		io.WriteString(conn, line+"\n")
		if i == 0 {
			if got, _ := c.readLine(pcReplyDeadline); got != "LOCKED\n" {
				t.Fatalf("got %q", got)
			}
		}
	}
	// The third connection's reply proves the second one is queued or about to be: poll.
	for {
		got, err := conns[2].readLine(pcReplyDeadline)
		if err != nil {
			t.Fatal(err)
		}
		if got == "waiting_workers: 1\n" {
			break
		}
		io.WriteString(conns[2].conn, "STATS waiting_workers\n")
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return")
	}
	for i, c := range conns {
		if got, err := c.readN(1, pcReplyDeadline); !errors.Is(err, io.EOF) {
			t.Errorf("conn %d: got %q (%v), want EOF", i, got, err)
		}
	}
	pcWaitGoroutines(t, "(*lockServer)")
	pcWaitGoroutines(t, "(*lockConn)")
	if _, err := net.DialTimeout("tcp", ln.Addr().String(), time.Second); err == nil {
		t.Error("listener still accepts after Serve returned")
	}
	if err := s.checkInvariants(); err != nil {
		t.Error(err)
	}
	if len(s.keys) != 0 || len(s.conns) != 0 {
		t.Errorf("after shutdown: %d keys, %d conns", len(s.keys), len(s.conns))
	}
}

// pcGoroutines counts goroutines whose stack mentions fn.
func pcGoroutines(fn string) int {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, fn) {
			n++
		}
	}
	return n
}

// pcWaitGoroutines waits until no goroutine mentions fn: a goroutine that has called
// WaitGroup.Done may still be on its way out when Wait returns.
func pcWaitGoroutines(t *testing.T, fn string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for pcGoroutines(fn) > 0 {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Errorf("goroutines of %s left:\n%s", fn, buf[:runtime.Stack(buf, true)])
			return
		}
		runtime.Gosched()
	}
}

// pcFlakyListener fails Accept with EMFILE a few times, then blocks until closed; it records
// when each Accept happened.
type pcFlakyListener struct {
	net.Listener
	fails  int
	mu     sync.Mutex
	calls  []time.Time
	called chan struct{}
	closed chan struct{}
	once   sync.Once
}

func (l *pcFlakyListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	l.calls = append(l.calls, time.Now())
	n := len(l.calls)
	l.mu.Unlock()
	l.called <- struct{}{}
	if n <= l.fails {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	<-l.closed
	return nil, net.ErrClosed
}

func (l *pcFlakyListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

// TestPoolCounterAcceptBackoff: failing accepts are retried with growing delays (the
// reference spins), counted in connect_errors, and do not end Serve.
func TestPoolCounterAcceptBackoff(t *testing.T) {
	s := newLockServer(pcTestLogger(t))
	l := &pcFlakyListener{fails: 5, called: make(chan struct{}, 16), closed: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, l) }()
	for i := 0; i < 6; i++ {
		select {
		case <-l.called:
		case <-time.After(5 * time.Second):
			t.Fatalf("accept call %d did not happen", i+1)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	want := poolCounterAcceptBackoffMin
	for i := 1; i < len(l.calls); i++ {
		if gap := l.calls[i].Sub(l.calls[i-1]); gap < want {
			t.Errorf("accept %d came %v after the previous, want >= %v", i+1, gap, want)
		}
		want *= 2
	}
	if s.stats.connectErrors != 5 {
		t.Errorf("connect_errors = %d, want 5", s.stats.connectErrors)
	}
}

// TestPoolCounterListen: address reuse, keepalive on accepted connections, and a backlog that
// holds 256 pending connects (the reference's 20 stalls the 22nd for a SYN retransmit).
func TestPoolCounterListen(t *testing.T) {
	ln, err := listenPoolCounter("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	getsockopt := func(rc syscall.RawConn, level, opt int) int {
		t.Helper()
		var v int
		var serr error
		if err := rc.Control(func(fd uintptr) { v, serr = syscall.GetsockoptInt(int(fd), level, opt) }); err != nil {
			t.Fatal(err)
		}
		if serr != nil {
			t.Fatal(serr)
		}
		return v
	}
	rc, err := ln.(*pcListener).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if getsockopt(rc, syscall.SOL_SOCKET, syscall.SO_REUSEADDR) == 0 {
		t.Error("SO_REUSEADDR not set")
	}
	var pending []net.Conn
	defer func() {
		for _, c := range pending {
			c.Close()
		}
	}()
	pendingMax := 256
	if b, err := os.ReadFile("/proc/sys/net/core/somaxconn"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n < pendingMax {
			t.Logf("net.core.somaxconn is %d: the backlog cannot exceed it", n)
			pendingMax = n
		}
	}
	for i := 0; i < pendingMax; i++ {
		c, err := net.DialTimeout("tcp", ln.Addr().String(), 500*time.Millisecond)
		if err != nil {
			t.Fatalf("connect %d with nobody accepting: %v", i+1, err)
		}
		pending = append(pending, c)
	}
	conn, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	crc, err := conn.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	pcCheckKeepAlive(t, crc) // on, with a schedule drawn from the daemon's policy
	// Address reuse: with a connection of the old socket still open (the server side closes
	// first and sits in TIME_WAIT), a new listener binds the same address at once.
	addr := ln.Addr().String()
	ln.Close()
	conn.Close()
	ln2, err := listenPoolCounter(addr)
	if err != nil {
		t.Fatalf("listen again on %s right after close: %v", addr, err)
	}
	ln2.Close()
	if _, err := listenPoolCounter("127.0.0.1:notaport"); err == nil || !strings.Contains(err.Error(), "poolcounter listen") {
		t.Errorf("bad address: %v", err)
	}
}

// TestPoolCounterBacklogWarning: a somaxconn that caps the backlog below what connection churn
// needs is named at start (with the fix), a sufficient one is not.
func TestPoolCounterBacklogWarning(t *testing.T) {
	for _, tc := range []struct {
		somaxconn int
		warn      bool
	}{{128, true}, {poolCounterBacklogWant - 1, true}, {poolCounterBacklogWant, false}, {4096, false}} {
		var log bytes.Buffer
		s := newLockServer(slog.New(slog.NewTextHandler(&log, nil)))
		s.checkBacklog(tc.somaxconn)
		got := strings.Contains(log.String(), "net.core.somaxconn caps the lock service's listen backlog") &&
			strings.Contains(log.String(), fmt.Sprintf("somaxconn=%d", tc.somaxconn))
		if got != tc.warn {
			t.Errorf("somaxconn %d: warned %v, want %v; log: %q", tc.somaxconn, got, tc.warn, log.String())
		}
	}
}
