// journal.go: the log's priorities for systemd's journal.
//
// Under systemd, standard error goes to the journal, which takes each line at the unit's
// default priority (info) unless the line starts with one in angle brackets (sd-daemon(3),
// SyslogLevelPrefix=, on by default): without it, journalctl -p warning finds none of the
// daemon's warnings and errors. systemd says the stream is the journal's by JOURNAL_STREAM,
// the device and inode of the file it connected; the daemon then starts each record with
// its level's priority. Elsewhere (a terminal, a file, a test) the records are unchanged.

package main

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"syscall"
)

// toJournal reports whether f is the stream JOURNAL_STREAM names.
func toJournal(f *os.File) bool {
	js := os.Getenv("JOURNAL_STREAM")
	if js == "" {
		return false
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return false
	}
	return js == fmt.Sprintf("%d:%d", st.Dev, st.Ino)
}

// journalWriter prefixes each record (one Write, one line: slog's text handler quotes the
// line ends of values) with its level's syslog priority.
type journalWriter struct{ w io.Writer }

func (j journalWriter) Write(p []byte) (int, error) {
	if _, err := io.WriteString(j.w, journalLine(string(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}

// journalLine is line with its priority first: <3> for ERROR, <4> WARN, <6> INFO, <7> DEBUG
// (levels between them take the one below). A line without a level is left as it is.
func journalLine(line string) string {
	_, rest, ok := strings.Cut(line, " level=")
	if !ok {
		return line
	}
	word, _, _ := strings.Cut(rest, " ")
	var level slog.Level
	if level.UnmarshalText([]byte(word)) != nil {
		return line
	}
	prio := "<7>"
	switch {
	case level >= slog.LevelError:
		prio = "<3>"
	case level >= slog.LevelWarn:
		prio = "<4>"
	case level >= slog.LevelInfo:
		prio = "<6>"
	}
	return prio + line
}
