//go:build !linux

// tty_other.go: whether a file is a terminal, where the Linux ioctl is not at hand: a
// character device other than /dev/null.

package main

import "os"

func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	if err != nil || st.Mode()&os.ModeCharDevice == 0 {
		return false
	}
	null, err := os.Stat(os.DevNull)
	return err != nil || !os.SameFile(st, null)
}
