// Package conffile reads pepsi.conf(5) for the programs beside the daemon (pepsi-queue): the
// [database] DSN and the names of the [stage-*] sections, under the daemon's own rules of what
// a well-formed file is, so that the operator's tool accepts exactly the files the daemon
// accepts and reads the same DSN from them; and the daemon's durations.
//
// The daemon keeps its own reader (parseINI in conf.go at the repository's root), so that an
// auditor reads its configuration in its package alone (it imports only small leaf packages of
// this module: the printing of text, the password's redaction, its sessions' settings). conf_readers_test.go at
// the root (FuzzConfReaders, FuzzDurations) holds the two to the same verdict, the same DSN,
// the same stages and the same line in an error, and to the same durations.
package conffile

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// File is what the tools read from a configuration file.
type File struct {
	Path   string
	DSN    string            // [database] DSN, "" when the file has none
	Stages map[string]bool   // the NAMEs of the [stage-NAME] sections
	Paused map[string]string // a [stage-NAME] section's PAUSED value, as written
}

// Error is a malformed file: Where is FILE:LINE (or FILE when it could not be read).
type Error struct {
	Where string
	Msg   string
}

func (e *Error) Error() string { return e.Where + ": " + e.Msg }

// MaxLine bounds one line, its terminator aside, as pepsi.conf(5) says ("up to 64 KiB").
const MaxLine = 64 << 10

// Read opens and parses path. A missing file is an error that wraps os.ErrNotExist (the
// caller may have the DSN from elsewhere, such as PEPSI_DSN).
func Read(path string) (*File, error) {
	f, err := os.Open(path)
	if err != nil {
		return &File{Stages: map[string]bool{}, Paused: map[string]string{}}, fmt.Errorf("read configuration: %w", err)
	}
	defer f.Close()
	return Parse(path, f)
}

// Parse reads the dialect: [section] headers, KEY = value lines, '#' and ';' comment lines,
// blank lines, each trimmed of surrounding white space. In pepsi's own sections a line without
// '=', a malformed key, a control character in a value and a key set twice are errors; the
// sections of other programs are skipped whatever they contain, as the daemon skips them.
func Parse(name string, r io.Reader) (*File, error) {
	c := &File{Path: name, Stages: map[string]bool{}, Paused: map[string]string{}}
	sc := bufio.NewScanner(r)
	// The buffer holds the longest allowed line with its "\r\n" (the scanner fails when a line
	// and its terminator do not fit).
	sc.Buffer(make([]byte, 4096), MaxLine+2)
	section := ""
	seen := map[string]bool{} // section + "\x00" + key
	n := 1
	for ; sc.Scan(); n++ {
		where := name + ":" + strconv.Itoa(n)
		if len(sc.Bytes()) > MaxLine {
			return c, tooLong(where)
		}
		line := sc.Text()
		if n == 1 {
			// A byte order mark, which some editors (Windows' Notepad) write at the start
			// of a UTF-8 file: not part of the first line's text.
			line = strings.TrimPrefix(line, "\uFEFF")
		}
		line = strings.TrimSpace(line)
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
			continue
		case line[0] == '[':
			if !strings.HasSuffix(line, "]") {
				return c, &Error{where, "section header " + short(line) + " lacks its closing ']'"}
			}
			section = strings.TrimSpace(line[1 : len(line)-1])
			if section == "" {
				return c, &Error{where, "empty section name"}
			}
			if ours(section) && strings.IndexFunc(section, isControl) >= 0 {
				return c, &Error{where, "section name " + short(section) + " contains a control character"}
			}
			if stage, ok := strings.CutPrefix(section, "stage-"); ok {
				c.Stages[stage] = true
			}
			continue
		}
		key, value, ok := strings.Cut(line, "=")
		if !ok {
			if ours(section) {
				return c, &Error{where, "expected KEY = value, got " + short(line)}
			}
			continue // another program's line
		}
		if section == "" {
			return c, &Error{where, "key outside any [section]"}
		}
		if !ours(section) {
			continue
		}
		key, value = strings.TrimSpace(key), strings.TrimSpace(value)
		if !validKey(key) {
			return c, &Error{where, short(key) + ": keys are upper-case letters, digits and '_'"}
		}
		if i := strings.IndexFunc(value, isControl); i >= 0 {
			// Not echoed: the value may be a password.
			r, _ := utf8.DecodeRuneInString(value[i:])
			return c, &Error{where, fmt.Sprintf("%s: the value contains the control character %U at byte %d; values are text", key, r, i+1)}
		}
		if seen[section+"\x00"+key] {
			return c, &Error{where, fmt.Sprintf("%s: set twice in [%s]", key, section)}
		}
		seen[section+"\x00"+key] = true
		if section == "database" && key == "DSN" {
			c.DSN = value
		}
		if stage, ok := strings.CutPrefix(section, "stage-"); ok && key == "PAUSED" {
			c.Paused[stage] = value
		}
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return c, tooLong(name + ":" + strconv.Itoa(n))
		}
		return c, &Error{name, fmt.Sprintf("cannot read: %v", err)}
	}
	return c, nil
}

func tooLong(where string) error {
	return &Error{where, fmt.Sprintf("line longer than %d bytes (64 KiB), the most a line may be", MaxLine)}
}

// ours reports whether a section is pepsi's (its lines are checked); the daemon's rule.
func ours(section string) bool {
	switch section {
	case "database", "pepsi-dispatch", "poolcounter":
		return true
	}
	return strings.HasPrefix(section, "stage-")
}

func validKey(k string) bool {
	if k == "" {
		return false
	}
	for _, c := range k {
		if !(c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// isControl reports a control character other than TAB.
func isControl(r rune) bool { return r != '\t' && unicode.IsControl(r) }

// short is s quoted with Go escapes and cut to about 60 bytes: a binary file given by mistake
// must not send control characters, or 64 KiB of them, to the operator's terminal.
func short(s string) string {
	const most = 60
	if len(s) <= most {
		return strconv.Quote(s)
	}
	cut := most
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return strconv.Quote(s[:cut]) + "…"
}

// ParseDuration is the daemon's rule for a duration in the file (conf.go's parseDuration, held
// to it by FuzzConfReaders): plain seconds ("300", "0.5") or a number with a unit suffix
// ("250ms", "5s", "2m", "1h", "7d"), the number trimmed of spaces before its unit.
func ParseDuration(v string) (time.Duration, error) {
	num, unit := v, time.Second
	for _, u := range []struct {
		suffix string
		d      time.Duration
	}{{"ms", time.Millisecond}, {"s", time.Second}, {"m", time.Minute}, {"h", time.Hour}, {"d", 24 * time.Hour}} {
		if strings.HasSuffix(v, u.suffix) {
			num, unit = strings.TrimSpace(strings.TrimSuffix(v, u.suffix)), u.d
			break
		}
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil || f < 0 || f != f || f > float64(1<<62)/float64(unit) {
		return 0, fmt.Errorf("want a duration such as 30, 0.5, 250ms, 5s, 2m or 1h, got %q", v)
	}
	return time.Duration(f * float64(unit)), nil
}
