package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"
)

// stderrRecords runs logLoop on a real pipe into which text is written (from another
// goroutine: a long text fills the pipe before logLoop reads), and returns the records it
// logged, each as its attributes, and the signs it reported.
func stderrRecords(t *testing.T, text string) ([]map[string]any, stderrSigns) {
	t.Helper()
	return stderrRecordsWith(t, text, &stderrBudget{})
}

// stderrRecordsWith is stderrRecords with the stage's line budget given.
func stderrRecordsWith(t *testing.T, text string, budget *stderrBudget) ([]map[string]any, stderrSigns) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		io.WriteString(w, text)
		w.Close()
	}()
	var out bytes.Buffer
	signs := logLoop(r, slog.New(slog.NewJSONHandler(&out, nil)), budget)
	r.Close()
	var recs []map[string]any
	for _, l := range strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n") {
		if l == "" {
			continue
		}
		var rec map[string]any
		if err := json.Unmarshal([]byte(l), &rec); err != nil {
			t.Fatalf("log record %q: %v", l, err)
		}
		recs = append(recs, rec)
	}
	return recs, signs
}

// TestLogLoopLongLine: a line of a worker's standard error longer than stderrLineMax (a
// handler that prints a whole payload) is logged cut, and every later line is still logged
// and still read for its signs. logLoop used a bufio.Scanner, which stops at the first line
// over its buffer: it drained the rest unread, so that worker's later lines, its last words
// and a refused session's line among them, never reached the log.
func TestLogLoopLongLine(t *testing.T) {
	long := strings.Repeat("x", 200_000)
	refused := `connect to the database: pq: too many connections for role "app" (53300)`
	exact := strings.Repeat("y", stderrLineMax)
	text := "first\r\n" + long + "\n" + refused + "\n\n" + exact + "\n" + "last words, no newline"
	recs, signs := stderrRecords(t, text)
	type want struct {
		line string
		cut  float64
	}
	wants := []want{
		{"first", 0},
		{long[:stderrLineMax], float64(len(long) - stderrLineMax)},
		{refused, 0},
		{"", 0},
		{exact, 0},
		{"last words, no newline", 0},
	}
	if len(recs) != len(wants) {
		t.Fatalf("%d records, want %d: %v", len(recs), len(wants), recs)
	}
	for i, w := range wants {
		rec := recs[i]
		cut, _ := rec["cut_bytes"].(float64)
		if rec["msg"] != "worker stderr" || rec["line"] != w.line || cut != w.cut {
			line, _ := rec["line"].(string)
			t.Errorf("record %d: msg %v, line of %d bytes (%.20q…), cut_bytes %v; want a line of %d bytes, cut %v",
				i, rec["msg"], len(line), line, rec["cut_bytes"], len(w.line), w.cut)
		}
	}
	if !signs.noSession {
		t.Errorf("the refused session's line after the long one was not seen: signs %+v", signs)
	}
}

// FuzzLogLines: readLogLine, on any bytes, whatever the reader's buffer and the limit, gives
// the lines that splitting at '\n' gives (a '\r' before it dropped, a last line without one
// kept), each cut to the limit with the bytes cut counted, and reads to the end.
func FuzzLogLines(f *testing.F) {
	for _, s := range []string{"", "\n", "a\nb", "a\r\nb\r", "\r\n\r\n", strings.Repeat("z", 40) + "\nq\n", "0123456789abcdef0\r\n"} {
		f.Add(s, uint8(16), uint8(5))
	}
	f.Fuzz(func(t *testing.T, text string, size, limit uint8) {
		r := bufio.NewReaderSize(strings.NewReader(text), 16+int(size%48))
		lim := 1 + int(limit%40)
		type piece struct {
			line string
			cut  int
		}
		var want []piece
		parts := strings.Split(text, "\n")
		if parts[len(parts)-1] == "" {
			parts = parts[:len(parts)-1]
		}
		for _, p := range parts {
			if len(p) > lim {
				want = append(want, piece{p[:lim], len(p) - lim})
			} else {
				want = append(want, piece{strings.TrimSuffix(p, "\r"), 0})
			}
		}
		var got []piece
		var buf []byte
		for {
			line, cut, err := readLogLine(r, buf[:0], lim)
			if err != nil {
				if err != io.EOF || len(line) != 0 || cut != 0 {
					t.Fatalf("error %v with a line %q, %d cut", err, line, cut)
				}
				break
			}
			buf = line
			got = append(got, piece{string(line), cut})
		}
		if len(got) != len(want) {
			t.Fatalf("%q (limit %d): %d lines %q, want %d %q", text, lim, len(got), got, len(want), want)
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("%q (limit %d): line %d is %+v, want %+v", text, lim, i, got[i], want[i])
			}
		}
	})
}

// TestLogLoopFlood: a stage whose workers print 5,000 lines at once has the first
// stderrLinesPerWindow logged, one line saying that the rest are left out, and every line
// still read for its signs (a refused session's words in the last line count). The next line,
// a window later, is preceded by the count of those left out. Every line was logged before: a
// stage that prints a line per message made the daemon's log that busy, and journald's rate
// limit then dropped the dispatcher's own lines with the stage's.
func TestLogLoopFlood(t *testing.T) {
	var text strings.Builder
	for i := range 5000 {
		fmt.Fprintf(&text, "line %d\n", i)
	}
	text.WriteString(`connect to the database: pq: too many connections for role "app" (53300)` + "\n")
	budget := &stderrBudget{}
	recs, signs := stderrRecordsWith(t, text.String(), budget)
	var logged, notices int
	for _, r := range recs {
		switch {
		case r["msg"] == "worker stderr":
			logged++
		case strings.Contains(r["msg"].(string), "the rest of them are left out"):
			notices++
		default:
			t.Errorf("unexpected record %v", r)
		}
	}
	if logged != stderrLinesPerWindow || notices != 1 {
		t.Errorf("%d lines logged and %d notices for 5,001 lines at once, want %d and 1", logged, notices, stderrLinesPerWindow)
	}
	if !signs.noSession {
		t.Errorf("the refused session's words, in a line left out, were not read")
	}
	budget.window = budget.window.Add(-stderrWindow) // a window later
	recs, _ = stderrRecordsWith(t, "after\n", budget)
	if len(recs) != 2 || recs[0]["lines"] != float64(4001) || recs[1]["line"] != "after" {
		t.Errorf("a window later: %v, want the count of the 4,001 lines left out, then the line", recs)
	}
}
