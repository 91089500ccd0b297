// stdio_linux.go: a worker's ids and replies on descriptors of their own.

package stage

import (
	"os"
	"syscall"
)

// protocolFiles moves the protocol off file descriptors 0 and 1 before the first handler
// runs (Run, RunStages). It returns close-on-exec copies of the process's standard input and
// output for the ids and the replies, so that a handler's children do not inherit them;
// then descriptor 0 (os.Stdin) reads /dev/null and descriptor 1 (os.Stdout) writes to
// standard error. What a handler prints, or a program it runs without capturing its output,
// reaches the dispatcher's log as its stderr lines: on the reply pipe it was a line that is
// no reply, a protocol error for which the dispatcher kills the worker, failing its message
// in flight (pepsi-worker(7)). A program that reads its standard input (ssh, ffmpeg without
// -nostdin) finds it at its end: on the id pipe it took the ids written while it ran, which
// were then never answered. Where a step fails, that half stays where it was.
func protocolFiles() (in, out *os.File) {
	in, out = os.Stdin, os.Stdout
	if fd, ok := moveFd(0, "/dev/null"); ok {
		in = os.NewFile(fd, "stdin (ids)")
	}
	if fd, ok := moveFd(1, ""); ok {
		out = os.NewFile(fd, "stdout (replies)")
	}
	return in, out
}

// moveFd copies descriptor fd to a new close-on-exec one, which it returns, and points fd at
// the file named (opened to read), or at standard error for "".
func moveFd(fd int, name string) (uintptr, bool) {
	cp, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), syscall.F_DUPFD_CLOEXEC, 3)
	if errno != 0 {
		return 0, false
	}
	src := 2
	if name != "" {
		f, err := os.Open(name)
		if err != nil {
			syscall.Close(int(cp))
			return 0, false
		}
		defer f.Close()
		src = int(f.Fd())
	}
	if err := syscall.Dup3(src, fd, 0); err != nil {
		syscall.Close(int(cp))
		return 0, false
	}
	return cp, true
}
