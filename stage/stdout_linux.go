// stdout_linux.go: a worker's replies on a descriptor of their own.

package stage

import (
	"os"
	"syscall"
)

// replyOutput moves the replies off file descriptor 1 before the first handler runs (Run,
// RunStages): it returns a copy of the process's standard output for them (close-on-exec, so
// that a handler's children do not inherit it) and points descriptor 1 at standard error,
// with os.Stdout. What a handler then prints, or a program it runs without capturing,
// reaches the dispatcher's log as its stderr lines; on the reply pipe it was a line that is
// no reply, a protocol error for which the dispatcher kills the worker, failing its message
// in flight and putting back the others (pepsi-worker(7)). If either step fails, the replies
// stay on descriptor 1, as before.
func replyOutput() *os.File {
	fd, _, errno := syscall.Syscall(syscall.SYS_FCNTL, 1, syscall.F_DUPFD_CLOEXEC, 3)
	if errno != 0 {
		return os.Stdout
	}
	if err := syscall.Dup3(2, 1, 0); err != nil {
		syscall.Close(int(fd))
		return os.Stdout
	}
	return os.NewFile(fd, "stdout (replies)")
}
