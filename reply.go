// reply.go: the worker reply grammar and its one parser.
//
// A worker prints one status line per message, in order: "STATUS[ TEXT]". On failure TEXT is
// the reason; on success it holds outcome words. Every word the dispatcher understands is
// parsed here, so FuzzReply covers the whole grammar (pepsi-worker(7) documents it).

package main

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// reply is one parsed status line.
type reply struct {
	status int    // 0 = success
	text   string // reason on failure; outcome words on success, as written

	// The outcome words of a success; a failure's text is a reason and has none.
	done      bool        // "done": the message reached done (dispatch_stats.done)
	fused     []fusedPass // "fused=STAGE:MS[,STAGE:MS…]": stages run in the same pass
	malformed []string    // fused= words with an entry that did not parse (logged, not fatal)
}

// fusedPass is one stage a worker ran inside the pass of another stage's message.
type fusedPass struct {
	stage string
	ms    int64
}

// replyStatusDigits bounds the status number: nine digits always fit an int, and no program
// needs more to say "failed".
const replyStatusDigits = 9

// parseReply parses "STATUS[ TEXT]": a decimal status, optionally followed by one space and
// text. Anything else is a protocol error: the worker and the dispatcher disagree about which
// message a line belongs to, so nothing after it can be trusted.
//
// On success TEXT is outcome words, separated by spaces (pepsi-worker(7)): "done" and
// "fused=STAGE:MS[,STAGE:MS…]"; other words are ignored, so a newer SDK may add words. A
// malformed fused= entry is not a protocol error (the message's own outcome is known): the
// entries before it count, it and the rest of its word are reported in malformed.
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
	r := reply{status: n, text: text}
	if n != 0 {
		return r, nil
	}
	for _, word := range strings.Fields(text) {
		switch {
		case word == "done":
			r.done = true
		case strings.HasPrefix(word, "fused="):
			for _, f := range strings.Split(strings.TrimPrefix(word, "fused="), ",") {
				name, msText, ok := strings.Cut(f, ":")
				ms, err := strconv.ParseInt(msText, 10, 64)
				if !ok || err != nil || ms < 0 || !stageNameRe.MatchString(name) {
					r.malformed = append(r.malformed, word)
					break
				}
				r.fused = append(r.fused, fusedPass{stage: name, ms: ms})
			}
		}
	}
	return r, nil
}

// clip shortens s to at most n bytes for a log line or a reason, marking the cut. The cut
// goes back to the start of a character, so it never splits one that was whole.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}
