package pgsession

import (
	"fmt"
	"syscall"
	"time"
)

// tcpUserTimeout is TCP_USER_TIMEOUT of <linux/tcp.h>, which package syscall does not name.
const tcpUserTimeout = 0x12

// setUserTimeout ends the connection on fd once data it sent has gone unacknowledged for d,
// keepalive probes included (tcp(7)).
func setUserTimeout(fd uintptr, d time.Duration) error {
	if err := syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, tcpUserTimeout, int(d.Milliseconds())); err != nil {
		return fmt.Errorf("set TCP_USER_TIMEOUT: %w", err)
	}
	return nil
}
