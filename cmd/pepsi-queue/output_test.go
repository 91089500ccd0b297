package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"pepsi-dispatch/internal/printable"
)

// TestTableShowsControlCharacters: an error text or a stage name that holds what a terminal
// acts on (ESC sequences that clear the screen or set its title, a BEL, a CR that writes over
// the line, C1 controls, a right-to-left override that reorders it on screen) is printed by
// the table and by show as escapes the operator reads, never as the characters themselves;
// the table's cut at 100 characters leaves UTF-8 whole; --json keeps the text exactly. Stage
// programs write these texts, and they often quote their input (an e-mail's subject, a
// remote server's answer).
func TestTableShowsControlCharacters(t *testing.T) {
	s := newQSchema(t)
	stage := "de\x1b[31mliver\u202e"
	errText := "boom \x1b]0;owned\x07\x1b[2J\rfine\u0085\u2066 tail\x7f"
	a := s.insert(t, stage, "failed", errText)
	s.insert(t, stage, "pending", "")            // for shape, which counts the messages not yet ended
	long := "x" + strings.Repeat("é", 99) + "€€" // byte 100 falls inside an é
	s.insert(t, "parse", "failed", long)

	unsafe := func(out string) string {
		if !utf8.ValidString(out) {
			return "bytes that are not UTF-8"
		}
		for _, r := range out {
			if r != '\n' && isUnsafe(r) {
				return fmt.Sprintf("%U", r)
			}
		}
		return ""
	}
	for _, args := range [][]string{
		{"status"}, {"shape"}, {"list"}, {"list", "--stage", stage}, {"errors"}, {"show", fmt.Sprint(a)},
	} {
		r := s.pq(t, "", args...)
		if r.code != 0 {
			t.Fatalf("%v: exit %d: %s", args, r.code, r.stderr)
		}
		if bad := unsafe(r.stdout); bad != "" {
			t.Errorf("%v printed %s:\n%q", args, bad, r.stdout)
		}
		if !strings.Contains(r.stdout, `de\x1b[31mliver\u202e`) {
			t.Errorf("%v: the stage name is not shown with its escapes:\n%s", args, r.stdout)
		}
	}
	r := s.pq(t, "", "list", "--stage", "parse")
	if want := "x" + strings.Repeat("é", 99) + "…"; !strings.Contains(r.stdout, want) {
		t.Errorf("list: the long error is not cut after its 100th character, as %q:\n%s", want, r.stdout)
	}
	r = s.pq(t, "", "list", "--stage", stage)
	if want := `boom \x1b]0;owned\x07\x1b[2J\x0dfine\u0085\u2066 tail\x7f`; !strings.Contains(r.stdout, want) {
		t.Errorf("list: the error is not shown as %s:\n%s", want, r.stdout)
	}

	r = s.pq(t, "", "--json", "list", "--stage", stage)
	var row map[string]any
	first, _, _ := strings.Cut(r.stdout, "\n")
	if err := json.Unmarshal([]byte(first), &row); err != nil {
		t.Fatalf("list --json: %v: %q", err, r.stdout)
	}
	if row["stage"] != stage || row["dispatch_error"] != errText {
		t.Errorf("list --json: stage %q, error %q; want them exactly as written", row["stage"], row["dispatch_error"])
	}
}

// isUnsafe: the characters of the test's texts that a terminal acts on (the test's own list,
// not the code's).
func isUnsafe(r rune) bool {
	return r < 0x20 || r == 0x7f || r >= 0x80 && r < 0xa0 || r == 0x202e || r == 0x2066
}

// FuzzPrintable: whatever the text, the table's cell and show's value are UTF-8 with no
// control or bidirectional formatting character, a text with none of them (and no tab or
// line feed, which the cell turns into a space and a cut) is printed as it is, and the cell
// holds at most 100 of the text's characters (each at most a six-character escape) and the
// mark of a cut.
func FuzzPrintable(f *testing.F) {
	for _, s := range []string{"", "plain", "boom \x1b]0;owned\x07\x1b[2J\r", "\xff\xfe", "a\u202eb\u2066c",
		"\u0085\u009f\u00a0", "\ufffd", strings.Repeat("é", 120), "two\nlines\tand a tab"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		shown := printable.String(s)
		line := cell("dispatch_error", s)
		for _, out := range []string{shown, line} {
			if !utf8.ValidString(out) {
				t.Fatalf("printable(%q) = %q: not UTF-8", s, out)
			}
			for _, r := range out {
				if unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r) {
					t.Fatalf("printable(%q) = %q: holds %U", s, out, r)
				}
			}
		}
		if utf8.ValidString(s) && strings.IndexFunc(s, func(r rune) bool {
			return unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r)
		}) < 0 && shown != s {
			t.Fatalf("printable(%q) = %q: changed a text with nothing to escape", s, shown)
		}
		if n := utf8.RuneCountInString(strings.TrimSuffix(line, "…")); n > 100*len(`\u202e`) {
			t.Fatalf("cell(%q) = %q: %d characters", s, line, n)
		}
	})
}
