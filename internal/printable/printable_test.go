package printable

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestEscapes(t *testing.T) {
	for _, c := range []struct{ in, str, lines string }{
		{"plain é", "plain é", "plain é"},
		{"a\u202etxt.exe", `a\u202etxt.exe`, `a\u202etxt.exe`},
		{"\x1b]0;owned\x07", `\x1b]0;owned\x07`, `\x1b]0;owned\x07`},
		{"two\nlines\tand\r", `two\x0alines\x09and\x0d`, "two\nlines\tand\\x0d"},
		{"caf\xe9 \u0085 \u2066x\u2069", `caf\xe9 \u0085 \u2066x\u2069`, `caf\xe9 \u0085 \u2066x\u2069`},
	} {
		if got := String(c.in); got != c.str {
			t.Errorf("String(%q) = %q, want %q", c.in, got, c.str)
		}
		if got := Lines(c.in); got != c.lines {
			t.Errorf("Lines(%q) = %q, want %q", c.in, got, c.lines)
		}
	}
}

// FuzzEscapes: whatever the text, String's result is UTF-8 with no control or bidirectional
// formatting character, Lines' the same but for line feeds and tabs; a text with nothing to
// escape comes out as it went in.
func FuzzEscapes(f *testing.F) {
	for _, s := range []string{"", "plain", "boom \x1b]0;owned\x07\x1b[2J\r", "\xff\xfe", "a\u202eb\u2066c",
		"\u0085\u009f\u00a0", "\ufffd", "two\nlines\tand a tab"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, keep := range []bool{false, true} {
			out := escape(s, keep)
			if !utf8.ValidString(out) {
				t.Fatalf("escape(%q, %v) = %q: not UTF-8", s, keep, out)
			}
			kept := func(r rune) bool { return keep && (r == '\n' || r == '\t') }
			for _, r := range out {
				if Unsafe(r) && !kept(r) {
					t.Fatalf("escape(%q, %v) = %q: holds %U", s, keep, out, r)
				}
			}
			if utf8.ValidString(s) && strings.IndexFunc(s, func(r rune) bool { return Unsafe(r) && !kept(r) }) < 0 && out != s {
				t.Fatalf("escape(%q, %v) = %q: changed a text with nothing to escape", s, keep, out)
			}
		}
	})
}
