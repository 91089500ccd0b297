// tty_linux.go: whether a file is a terminal (the confirmation prompt's test), by the ioctl
// that only terminals answer: /dev/null is a character device too, and must not count.

package main

import (
	"os"
	"syscall"
	"unsafe"
)

func isTerminal(f *os.File) bool {
	var t syscall.Termios
	_, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), syscall.TCGETS, uintptr(unsafe.Pointer(&t)))
	return errno == 0
}
