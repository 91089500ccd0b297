//go:build !linux

// stdio_other.go: the protocol stays on standard input and output where the dispatcher, which
// runs on Linux alone, never starts a worker (a stage's tests on a developer's machine, say).

package stage

import "os"

// protocolFiles is os.Stdin and os.Stdout: see stdio_linux.go.
func protocolFiles() (in, out *os.File) { return os.Stdin, os.Stdout }
