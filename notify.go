// notify.go: systemd's readiness and watchdog protocol (sd_notify), with the standard library.
//
// Under a Type=notify unit, systemd passes a datagram socket in NOTIFY_SOCKET. The daemon
// sends READY=1 once it holds the single-instance lock and listens, STOPPING=1 when shutdown
// begins, and WATCHDOG=1 at half the WatchdogSec period from the coordinator's own loop, so a
// wedged coordinator stops the pings and systemd restarts it. Without NOTIFY_SOCKET every call
// is a no-op.

package main

import (
	"net"
	"os"
	"strconv"
	"time"
)

// notifier sends sd_notify datagrams; the zero value (nil conn) sends nothing.
type notifier struct {
	conn *net.UnixConn
}

// newNotifier connects to NOTIFY_SOCKET if systemd set one. An address starting with '@' is
// in the abstract namespace.
func newNotifier() *notifier {
	addr := os.Getenv("NOTIFY_SOCKET")
	if addr == "" {
		return &notifier{}
	}
	if addr[0] == '@' {
		addr = "\x00" + addr[1:]
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		return &notifier{} // not fatal: the unit's readiness then times out and says so
	}
	return &notifier{conn: conn}
}

// send writes one state datagram ("READY=1", "STOPPING=1", "WATCHDOG=1", "STATUS=…").
func (n *notifier) send(state string) {
	if n == nil || n.conn == nil {
		return
	}
	n.conn.Write([]byte(state)) // best effort: systemd may be gone during shutdown
}

func (n *notifier) close() {
	if n != nil && n.conn != nil {
		n.conn.Close()
	}
}

// watchdogInterval returns how often to send WATCHDOG=1: half of WATCHDOG_USEC, or 0 when the
// unit has no watchdog (or it is meant for another process).
func watchdogInterval() time.Duration {
	usec, err := strconv.ParseInt(os.Getenv("WATCHDOG_USEC"), 10, 64)
	if err != nil || usec <= 0 {
		return 0
	}
	if pid := os.Getenv("WATCHDOG_PID"); pid != "" && pid != strconv.Itoa(os.Getpid()) {
		return 0
	}
	return time.Duration(usec) * time.Microsecond / 2
}
