// inherited.go: descriptors the daemon was started with.
//
// A descriptor its parent left open without close-on-exec (a start-up script's
// `exec 3>>/var/log/app.log`, a supervisor's pipe, a terminal session's) is the daemon's too,
// and was every worker's: Go opens its own descriptors close-on-exec, but inherited ones stay
// as they came, and a child gets every open descriptor without the flag. The workers run as
// USER, after the privilege drop: a file the root parent had opened, which USER may not open,
// reached each of them open (TestInheritedDescriptorsNotPassedOn). The daemon uses none of
// them (it takes no socket from systemd), so at its start every descriptor past standard
// error is marked close-on-exec: still open for whatever the parent meant it, never passed on.

package main

import (
	"fmt"
	"os"
	"strconv"
	"syscall"
)

// keepInheritedFromWorkers marks every descriptor past standard error close-on-exec.
func keepInheritedFromWorkers() error {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return fmt.Errorf("list the descriptors the daemon was started with: %w", err)
	}
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd > 2 {
			syscall.CloseOnExec(fd) // the directory's own descriptor, closed by now, is harmless
		}
	}
	return nil
}
