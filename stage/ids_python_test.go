// ids_python_test.go: the Go SDK and the Python SDK (../python/pepsi_stage.py) read a stage's
// standard input alike: the same lines (a last one without LF, a line past 64 KiB cut to its
// first 64 KiB), each read as the same message id or refused as none, so a stage answers the
// same bytes the same way whichever language it is written in. The dispatcher writes plain
// decimal ids; the rest is what a person typing ids by hand, or a bug, sends. pepsi-worker(7)
// and doc/python.md give the rule.

package stage

import (
	"bytes"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

// pyStage is a Python stage program that advances every message to b.
const pyStage = `
import pepsi_stage
pepsi_stage.run(lambda m: m.advance("b"))
`

// runStages runs the Go and the Python stage program for stage a, each on a schema of its own
// (the same rows with the same ids), with in as standard input, and returns their replies.
func runStages(t *testing.T, goSch, pySch *schema, in []byte) (goOut, pyOut []string) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatalf("find the test binary (the Go stage program): %v", err)
	}
	python, dir, err := pythonAndSDK()
	if err != nil {
		t.Fatal(err)
	}
	run := func(cmd *exec.Cmd, sch *schema, env ...string) []string {
		cmd.Env = append(os.Environ(), "PEPSI_STAGE=a", "PEPSI_NEXT=b", "PEPSI_DSN="+sch.dsn)
		cmd.Env = append(cmd.Env, env...)
		cmd.Stdin = bytes.NewReader(in)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%s: %v\n%s", cmd.Path, err, stderr.Bytes())
		}
		return strings.SplitAfter(string(out), "\n")
	}
	// TestMain's stage program, which advances to b too.
	goOut = run(exec.Command(exe, "worker"), goSch, "PEPSI_SDK_TEST_RUN=1")
	pyOut = run(exec.Command(python, "-c", pyStage, "worker"), pySch, "PYTHONPATH="+dir)
	return goOut, pyOut
}

// class is what a reply says about its line: run (0), refused as no id, or another failure
// (an id whose row is not running at a: "claim lost" and the like). The reasons' wording
// differs between the SDKs (Go's %q, Python's repr).
func class(reply string) string {
	switch {
	case reply == "0\n":
		return "ran"
	case strings.HasPrefix(reply, "1 bad message id "):
		return "not an id"
	case strings.HasPrefix(reply, "1 "), reply == "1\n":
		return "failed"
	}
	return fmt.Sprintf("unexpected %q", reply)
}

// TestIDLinesSameInPython: the same bytes on standard input, to a Go and a Python stage
// program, real processes: the same number of replies, each of the same class, and the same
// rows advanced.
func TestIDLinesSameInPython(t *testing.T) {
	goSch, pySch := newSchema(t), newSchema(t)
	var ids []int64
	for i := 0; i < 40; i++ {
		a, b := goSch.put(t, "a", "running", `{}`), pySch.put(t, "a", "running", `{}`)
		if a != b {
			t.Fatalf("the two schemas' rows have ids %d and %d", a, b)
		}
		ids = append(ids, a)
	}
	// Each line names a row of its own, so a line read as its id runs it and nothing else.
	id := func(i int) string { return strconv.FormatInt(ids[i], 10) }
	lines := []string{
		id(0), " " + id(1), "\t" + id(2) + "\r", id(3) + " ", "\v" + id(4) + "\f", "0" + id(5), "000" + id(6),
		"+" + id(7), "-" + id(8), id(9) + "\u00a0", "\u00a0" + id(10), "\u2003" + id(11), "\u0085" + id(12),
		"\x1c" + id(13), id(14) + "\x00", id(15) + " " + id(16), "٣", "１", id(17) + ".0", id(18) + "e0",
		"0x" + id(19), "", " ", "\r", "abc", "\xff", "0", "-0", "9223372036854775807", "9223372036854775808",
		"99999999999999999999", strings.Repeat("0", 5000) + id(20), strings.Repeat("9", 5000),
		strings.Repeat("0", 64<<10-len(id(21))) + id(21), // 64 KiB exactly: the whole line, an id
		strings.Repeat("0", 64<<10) + id(22),             // past 64 KiB: cut to its first 64 KiB, id 0
		strings.Repeat(" ", 70000) + id(23), id(24) + strings.Repeat(" ", 70000),
		id(25) + "\r\r", id(26),
	}
	in := []byte(strings.Join(lines, "\n") + "\n")
	goOut, pyOut := runStages(t, goSch, pySch, in)
	if len(goOut) != len(lines)+1 || len(pyOut) != len(goOut) { // SplitAfter leaves "" after the last LF
		t.Fatalf("%d lines: Go answered %d, Python %d", len(lines), len(goOut)-1, len(pyOut)-1)
	}
	for i, line := range lines {
		g, p := class(goOut[i]), class(pyOut[i])
		if g != p || strings.HasPrefix(g, "unexpected") {
			short := line
			if len(short) > 40 {
				short = short[:20] + "..." + short[len(short)-20:]
			}
			t.Errorf("line %q: Go %s (%q), Python %s (%q)", short, g, cut(goOut[i]), p, cut(pyOut[i]))
		}
	}
	q := `SELECT workqueue_id FROM workqueue WHERE stage = 'b' ORDER BY 1`
	if g, p := goSch.ids(t, q), pySch.ids(t, q); fmt.Sprint(g) != fmt.Sprint(p) {
		t.Errorf("rows advanced: Go %v, Python %v", g, p)
	}

	// The end of the input: a last line without LF counts, however short; nothing after a
	// last LF does.
	for _, c := range []struct {
		in      string
		replies int
	}{{id(30), 1}, {id(31) + "\n" + id(32), 2}, {id(33) + "\n\r", 2}, {id(34) + "\n ", 2}, {"\n", 1}, {"", 0},
		{strings.Repeat("0", 70000) + id(35), 1}} {
		goOut, pyOut := runStages(t, goSch, pySch, []byte(c.in))
		if len(goOut)-1 != c.replies || len(pyOut)-1 != c.replies {
			t.Errorf("input %q: Go answered %q, Python %q; want %d replies each", cut(c.in), goOut, pyOut, c.replies)
			continue
		}
		for i := 0; i < c.replies; i++ {
			if g, p := class(goOut[i]), class(pyOut[i]); g != p {
				t.Errorf("input %q, reply %d: Go %s, Python %s", cut(c.in), i+1, g, p)
			}
		}
	}
}

func cut(s string) string {
	if len(s) > 60 {
		return s[:30] + "..." + s[len(s)-30:]
	}
	return s
}

// TestIDLineSameInPython: the rule alone, through the python3 process of
// config_python_test.go, on a table and on random lines of the bytes that matter.
func TestIDLineSameInPython(t *testing.T) {
	py := pythonSDK(t)
	lines := []string{"1", " 1", "1 ", "\t1\r", "\v1\f", "01", "+1", "-1", "1\u00a0", "\u00a01", "\u00851",
		"\x1c1", "1\x00", "1 2", "٣", "１", "", " ", "\r", "0", "9223372036854775807", "9223372036854775808",
		"00000000000000000000009223372036854775807", "99999999999999999999", strings.Repeat("9", 5000)}
	rng := rand.New(rand.NewSource(1))
	alphabet := []string{"0", "1", "9", " ", "\t", "\r", "\v", "\f", "\n", "+", "-", "\x00", "\x1c", "\u00a0", "٣", "a"}
	for i := 0; i < 5000; i++ {
		var b strings.Builder
		for n := rng.Intn(22); n > 0; n-- {
			b.WriteString(alphabet[rng.Intn(len(alphabet))])
		}
		lines = append(lines, b.String())
	}
	for _, line := range lines {
		sameID(t, py, line)
	}
}

// FuzzIDLineSameInPython: any line, read by both SDKs' rule: the same id, or refused by both.
func FuzzIDLineSameInPython(f *testing.F) {
	for _, s := range []string{"1", " 1\r", "+1", "٣", "9223372036854775808", "0001"} {
		f.Add(s)
	}
	py := pythonSDK(f)
	f.Fuzz(func(t *testing.T, line string) {
		sameID(t, py, line)
	})
}

func sameID(t testing.TB, py *pySDK, line string) {
	t.Helper()
	id, ok := parseID(line)
	a := py.ask(t, map[string]any{"id_line": []byte(line)}) // []byte: base64, any bytes
	if a.Crash != "" {
		t.Fatalf("Python on id line %q: %s", cut(line), a.Crash)
	}
	if ok != (a.ID != nil) || (ok && strconv.FormatInt(id, 10) != *a.ID) {
		py := "refused"
		if a.ID != nil {
			py = *a.ID
		}
		t.Errorf("id line %q: Go %d, %v; Python %s", cut(line), id, ok, py)
	}
}
