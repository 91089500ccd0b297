// poolcounter_conn_test.go: tests of a connection's output (poolcounter_conn.go): a client
// that stops reading stalls nobody else, and its queue is bounded.

package main

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// TestPoolCounterSlowClient: a client that pipelines requests and never reads fills its socket;
// a handoff to it must not stall the releaser or anyone else.
func TestPoolCounterSlowClient(t *testing.T) {
	s, addr := startOurs(t)
	s.mu.Lock()
	s.writeTimeout = time.Hour // the socket stays full; only the queue bound may act
	s.mu.Unlock()
	dial := func() *pcClient {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return &pcClient{conn: conn, r: bufio.NewReader(conn)}
	}
	roundTrip := func(c *pcClient, line, want string) {
		t.Helper()
		c.conn.SetWriteDeadline(time.Now().Add(pcReplyDeadline)) //nolint:errcheck // the write fails if not applied
		if _, err := io.WriteString(c.conn, line+"\n"); err != nil {
			t.Fatal(err)
		}
		got, err := c.readLine(pcReplyDeadline)
		if got != want+"\n" {
			t.Fatalf("%s: got %q (%v), want %q", line, got, err, want)
		}
	}
	holder, slow, other := dial(), dial(), dial()
	roundTrip(holder, "ACQ4ME k 1 10 60", "LOCKED")
	// slow waits for k, then floods STATS FULL without reading until its writes stall: then
	// both socket buffers are full and the server's writes to it block.
	if _, err := io.WriteString(slow.conn, "ACQ4ME k 1 10 60\n"); err != nil {
		t.Fatal(err)
	}
	flood := bytes.Repeat([]byte("STATS FULL\n"), 1000)
	for {
		slow.conn.SetWriteDeadline(time.Now().Add(200 * time.Millisecond)) //nolint:errcheck // see below
		if _, err := slow.conn.Write(flood); err != nil {
			if !pcIsTimeout(err) {
				t.Fatal(err)
			}
			break
		}
	}
	// The handoff LOCKED to slow cannot be written; the releaser still gets its reply at once,
	// and other clients are served.
	start := time.Now()
	roundTrip(holder, "RELEASE", "RELEASED")
	roundTrip(other, "ACQ4ME k2 1 1 0", "LOCKED")
	roundTrip(other, "STATS processing_workers", "processing_workers: 2")
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("took %v with a stalled client", d)
	}
	slow.conn.Close()
	// slow's locks are freed when it goes away.
	deadline := time.Now().Add(pcReplyDeadline)
	for {
		c := dial()
		c.conn.SetDeadline(deadline) //nolint:errcheck // the read fails if not applied
		io.WriteString(c.conn, "STATS processing_workers\n")
		got, _ := c.readLine(pcReplyDeadline)
		c.conn.Close()
		if got == "processing_workers: 1\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("slow client's lock not freed: %q", got)
		}
	}
}

// TestPoolCounterOutputBound: replies queued for a connection are bounded; past the bound the
// connection is dropped and its locks freed.
func TestPoolCounterOutputBound(t *testing.T) {
	s := newLockServer(pcTestLogger(t))
	s.maxOutput = 64
	a, b := net.Pipe() // nobody reads b: every write to a blocks
	defer b.Close()
	c := &lockConn{s: s, nc: a, remote: "pipe"}
	s.mu.Lock()
	s.queue(c, "0123456789012345678901234567890123456789\n") // queued, no writer
	s.queue(c, "0123456789012345678901234567890123456789\n") // over the bound
	broken, failed := c.broken, s.stats.failedSends
	s.mu.Unlock()
	if !broken || failed != 1 {
		t.Fatalf("broken=%v failed_sends=%d, want true 1", broken, failed)
	}
	if _, err := a.Read(make([]byte, 1)); !errors.Is(err, io.ErrClosedPipe) {
		t.Errorf("connection not closed: %v", err)
	}
}
