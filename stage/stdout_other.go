//go:build !linux

// stdout_other.go: replies stay on standard output where the dispatcher, which runs on Linux
// alone, never starts a worker (a stage's tests on a developer's machine, say).

package stage

import "os"

// replyOutput is os.Stdout: see stdout_linux.go.
func replyOutput() *os.File { return os.Stdout }
