// Package printable writes text that others wrote (stage names, failure reasons, payloads)
// so that what a terminal or a browser would act on or reorder is shown instead: pepsi-queue
// prints through it, and so does the console.
//
// Errors and stage names are written by stage programs and producers, which often quote their
// input (an e-mail's subject, a remote server's answer). On a terminal an ESC there is a
// command (clear the screen, set its title, hide the rest of the line); in a terminal or a
// browser, Unicode's bidirectional formatting characters reorder what follows them, so that
// "U+202E txt.exe" reads "exe.txt".
package printable

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// String returns s with what a terminal would act on rather than show written as Go escapes
// (\x1b, \u202e): control characters (C0, DEL, C1), the bidirectional formatting characters,
// and bytes that are not UTF-8 (\xff). A text with none of them is returned as it is.
func String(s string) string { return escape(s, false) }

// Lines is String for text shown over several lines (a payload's JSON, a multi-line error on
// a web page): it keeps line feeds and tabs.
func Lines(s string) string { return escape(s, true) }

func escape(s string, keepLines bool) string {
	unsafe := func(r rune) bool { return Unsafe(r) && !(keepLines && (r == '\n' || r == '\t')) }
	i := strings.IndexFunc(s, func(r rune) bool { return r == utf8.RuneError || unsafe(r) })
	if i < 0 {
		return s
	}
	var b strings.Builder
	b.WriteString(s[:i])
	for s = s[i:]; s != ""; {
		r, n := utf8.DecodeRuneInString(s)
		switch {
		case r == utf8.RuneError && n == 1:
			fmt.Fprintf(&b, `\x%02x`, s[0])
		case r < 0x80 && unsafe(r):
			fmt.Fprintf(&b, `\x%02x`, r)
		case unsafe(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[:n])
		}
		s = s[n:]
	}
	return b.String()
}

// Unsafe reports whether r is a control character, or one of Unicode's bidirectional
// formatting characters (Bidi_Control: the marks U+061C, U+200E, U+200F; the embeddings and
// overrides U+202A to U+202E; the isolates U+2066 to U+2069).
func Unsafe(r rune) bool {
	return unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r)
}
