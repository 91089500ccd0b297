package pgsession

import (
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"
	"testing"
	"time"
)

// TestDialerSocketOptions: a session's socket probes on the Keepalive schedule and gives up on
// unacknowledged data within Vanish, as the lock session asks of the server.
func TestDialerSocketOptions(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := Dialer{Vanish: 10 * time.Second}.DialContext(context.Background(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	rc.Control(func(fd uintptr) {
		for name, opt := range map[string][2]int{
			"SO_KEEPALIVE":     {syscall.SOL_SOCKET, syscall.SO_KEEPALIVE},
			"TCP_KEEPIDLE":     {syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE},
			"TCP_KEEPINTVL":    {syscall.IPPROTO_TCP, syscall.TCP_KEEPINTVL},
			"TCP_KEEPCNT":      {syscall.IPPROTO_TCP, syscall.TCP_KEEPCNT},
			"TCP_USER_TIMEOUT": {syscall.IPPROTO_TCP, tcpUserTimeout},
		} {
			v, err := syscall.GetsockoptInt(int(fd), opt[0], opt[1])
			if err != nil {
				t.Errorf("getsockopt %s: %v", name, err)
			}
			got[name] = v
		}
	})
	want := map[string]int{"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 5, "TCP_KEEPINTVL": 1, "TCP_KEEPCNT": 5, "TCP_USER_TIMEOUT": 10000}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("%s = %d, want %d", name, got[name], w)
		}
	}
}

// silentAddr is an address whose connects go unanswered, as a vanished machine's: a listener
// that never accepts, its accept queue (backlog 0: one connection) filled, so that the kernel
// drops the SYNs of every further connect.
func silentAddr(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
	for range 8 {
		c, err := net.DialTimeout("tcp", addr, 300*time.Millisecond)
		if err != nil {
			t.Cleanup(func() { unanswered.note(addr, nil, 0, 0) })
			return addr // the queue is full: this connect went unanswered
		}
		t.Cleanup(func() { c.Close() })
	}
	t.Fatalf("the accept queue of %s never filled", addr)
	return ""
}

// TestDialerPassesOverUnanswered: a host that did not answer a connect is passed over at once
// for a while, so that lib/pq goes on to a DSN's next host without waiting on it again; a host
// that answers is tried, and a success forgets what was remembered of it. With one host in the
// DSN there is no other: it is tried every time.
func TestDialerPassesOverUnanswered(t *testing.T) {
	if d := DialerFor("host=a,b", time.Second); !d.PassOver {
		t.Errorf("DialerFor with two hosts does not pass over")
	}
	if d := DialerFor("host=a", time.Second); d.PassOver {
		t.Errorf("DialerFor with one host passes over")
	}
	d := Dialer{Vanish: 2 * time.Second, PassOver: true} // a connect bounded by 1 s
	silent := silentAddr(t)
	start := time.Now()
	if _, err := d.DialContext(context.Background(), "tcp", silent); err == nil {
		t.Fatalf("connected to %s", silent)
	} else {
		t.Logf("first connect: %v after %v", err, time.Since(start).Round(time.Millisecond))
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("the first connect took %v, want its bound (1 s)", took)
	}
	start = time.Now()
	_, err := d.DialContext(context.Background(), "tcp", silent)
	if !errors.Is(err, errUnanswered) {
		t.Fatalf("second connect: %v, want errUnanswered", err)
	}
	var ne net.Error
	if !errors.As(err, &ne) {
		t.Errorf("second connect's error %T is no net.Error: the dispatcher would not take it for an unreachable database", err)
	}
	if took := time.Since(start); took > 100*time.Millisecond {
		t.Errorf("the host passed over took %v", took)
	}
	alone := Dialer{Vanish: 2 * time.Second}
	start = time.Now()
	if _, err := alone.DialContext(context.Background(), "tcp", silent); errors.Is(err, errUnanswered) || time.Since(start) < 900*time.Millisecond {
		t.Errorf("the only host of a DSN was passed over (%v after %v)", err, time.Since(start).Round(time.Millisecond))
	}

	// A listener's address remembered as unanswered is passed over until the while is over,
	// then tried, and forgotten once it answers.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	live := ln.Addr().String()
	unanswered.note(live, context.DeadlineExceeded, time.Second, time.Hour)
	if _, err := d.DialContext(context.Background(), "tcp", live); !errors.Is(err, errUnanswered) {
		t.Fatalf("remembered host: %v, want errUnanswered", err)
	}
	unanswered.mu.Lock()
	unanswered.until[live] = time.Now().Add(-time.Millisecond)
	unanswered.mu.Unlock()
	c, err := d.DialContext(context.Background(), "tcp", live)
	if err != nil {
		t.Fatalf("host after the while: %v", err)
	}
	c.Close()
	unanswered.mu.Lock()
	_, still := unanswered.until[live]
	unanswered.mu.Unlock()
	if still {
		t.Errorf("a host that answered is still remembered as unanswered")
	}

	// A connect whose caller's deadline was all but spent proves nothing of the host.
	other := silentAddr(t)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := d.DialContext(ctx, "tcp", other); err == nil {
		t.Fatalf("connected to %s", other)
	}
	if err := unanswered.check("tcp", other); err != nil {
		t.Errorf("a connect cut by its caller's 50 ms deadline marked the host: %v", err)
	}
}

// TestDialerConnectTimeoutStands: with the DSN's connect_timeout, lib/pq bounds each host's
// connect, and the Dialer adds no bound of its own (a longer one stands).
func TestDialerConnectTimeoutStands(t *testing.T) {
	if d := DialerFor("host=a,b connect_timeout=30", 10*time.Second); d.ConnectTimeout != 30*time.Second {
		t.Errorf("DialerFor: ConnectTimeout %v, want 30s", d.ConnectTimeout)
	}
	if d := DialerFor("host=a,b", 10*time.Second); d.ConnectTimeout != 0 {
		t.Errorf("DialerFor without connect_timeout: %v, want 0", d.ConnectTimeout)
	}
	d := Dialer{Vanish: 2 * time.Second, ConnectTimeout: 30 * time.Second}
	silent := silentAddr(t)
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := d.DialContext(ctx, "tcp", silent); err == nil {
		t.Fatalf("connected to %s", silent)
	}
	if took := time.Since(start); took < 1400*time.Millisecond {
		t.Errorf("connect gave up after %v under a 1.5 s deadline of lib/pq's: the Dialer's own 1 s bound cut it", took)
	}
}
