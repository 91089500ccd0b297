// reply.go: the worker reply grammar and its one parser.
//
// A worker prints one status line per message, in order: "STATUS[ TEXT]". On failure TEXT is
// the reason; on success it holds outcome words. Every word the dispatcher understands is
// parsed here, so FuzzReply covers the whole grammar (pepsi-worker(7) documents it).

package main

import (
	"fmt"
	"strings"
)

// reply is one parsed status line.
type reply struct {
	status int    // 0 = success
	text   string // reason on failure; outcome words on success
}

// replyStatusDigits bounds the status number: nine digits always fit an int, and no program
// needs more to say "failed".
const replyStatusDigits = 9

// parseReply parses "STATUS[ TEXT]": a decimal status, optionally followed by one space and
// text. Anything else is a protocol error: the worker and the dispatcher disagree about which
// message a line belongs to, so nothing after it can be trusted.
func parseReply(line string) (reply, error) {
	num, text, _ := strings.Cut(line, " ")
	if num == "" {
		return reply{}, fmt.Errorf("protocol error: empty status in %q", clip(line, 80))
	}
	if len(num) > replyStatusDigits {
		return reply{}, fmt.Errorf("protocol error: status %q is too long", clip(num, 20))
	}
	n := 0
	for _, c := range []byte(num) {
		if c < '0' || c > '9' {
			return reply{}, fmt.Errorf("protocol error: status line %q does not start with a decimal status", clip(line, 80))
		}
		n = n*10 + int(c-'0')
	}
	return reply{status: n, text: text}, nil
}

// clip shortens s for a log line or a reason, marking the cut.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
