//go:build !linux

package pgsession

import "time"

// setUserTimeout does nothing where TCP_USER_TIMEOUT is not Linux's (pepsi-queue on another
// system): the keepalive probes alone bound an unanswered read there.
func setUserTimeout(uintptr, time.Duration) error { return nil }
