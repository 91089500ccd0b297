// poolcounter_protocol.go: the PoolCounter line protocol on the wire (doc/design/lockservice.md,
// Framing and Requests): the reply words, cutting a byte stream into bounded request lines,
// and decoding one line into a request the way poolcounterd does.
//
// Owns: pcLineFramer, pcRequest and parsePoolCounterLine, the reply constants.
// Must not touch: the lock table, connections or statistics; everything here is a pure
// function of its input, which is what FuzzPoolCounterLine relies on.

package main

import "bytes"

// poolCounterMaxLineDefault bounds one request line, "\n" included. The reference reads into
// a 1024-byte buffer, so 1023 bytes + "\n" is the longest line it ever understood; a longer
// line here gets "ERROR LINE_TOO_LONG" instead of being silently mangled.
const poolCounterMaxLineDefault = 1024

// Replies: poolcounterd's exact bytes, plus our ERROR LINE_TOO_LONG and the newline of WRONG_STAT.
const (
	pcLocked          = "LOCKED\n"
	pcDone            = "DONE\n"
	pcTimeout         = "TIMEOUT\n"
	pcQueueFull       = "QUEUE_FULL\n"
	pcLockHeld        = "LOCK_HELD\n"
	pcReleased        = "RELEASED\n"
	pcNotLocked       = "NOT_LOCKED\n"
	pcBadCommand      = "ERROR BAD_COMMAND\n"
	pcBadSyntax       = "ERROR BAD_SYNTAX\n"
	pcWaitForResponse = "ERROR WAIT_FOR_RESPONSE\n"
	pcWrongStat       = "ERROR WRONG_STAT\n" // the reference omits the "\n", hanging line readers
	pcLineTooLong     = "ERROR LINE_TOO_LONG\n"
)

// ---------------------------------------------------------------------------------------------
// Request parsing (doc/design/lockservice.md, Requests)

type pcOp uint8

const (
	pcOpBad pcOp = iota
	pcOpAcqMe
	pcOpAcqAny
	pcOpRelease
	pcOpStats
)

type pcRequest struct {
	op        pcOp
	key       []byte // ACQ: aliases the line
	workers   uint32
	maxQueue  uint32
	timeout   uint32 // seconds; 0 = do not wait
	badSyntax bool   // ACQ without key, or workers/maxqueue 0 or not a number
	item      []byte // STATS: everything after "STATS "
}

// parsePoolCounterLine decodes one request line (without its "\n") the way the reference does:
// one trailing "\r" is dropped, the line ends at a NUL byte (C strings), commands are
// case-sensitive prefixes, ACQ arguments are separated by runs of spaces only.
func parsePoolCounterLine(line []byte) pcRequest {
	if n := len(line); n > 0 && line[n-1] == '\r' {
		line = line[:n-1]
	}
	if i := bytes.IndexByte(line, 0); i >= 0 {
		line = line[:i]
	}
	var req pcRequest
	var args []byte
	switch {
	case bytes.HasPrefix(line, []byte("ACQ4ME ")):
		req.op, args = pcOpAcqMe, line[len("ACQ4ME "):]
	case bytes.HasPrefix(line, []byte("ACQ4ANY ")):
		req.op, args = pcOpAcqAny, line[len("ACQ4ANY "):]
	case bytes.HasPrefix(line, []byte("RELEASE")):
		req.op = pcOpRelease // any continuation is ignored (python-poolcounter sends the key)
		return req
	case bytes.HasPrefix(line, []byte("STATS ")):
		req.op, req.item = pcOpStats, line[len("STATS "):]
		return req
	default:
		return req
	}
	var tok [4][]byte
	for i := range tok {
		tok[i], args = pcNextToken(args)
	}
	req.key = tok[0]
	req.workers, req.maxQueue, req.timeout = pcAtou32(tok[1]), pcAtou32(tok[2]), pcAtou32(tok[3])
	req.badSyntax = len(req.key) == 0 || req.workers == 0 || req.maxQueue == 0
	return req
}

// pcNextToken splits off the next space-separated token, skipping runs of spaces (strtok " ").
func pcNextToken(b []byte) (tok, rest []byte) {
	for len(b) > 0 && b[0] == ' ' {
		b = b[1:]
	}
	i := bytes.IndexByte(b, ' ')
	if i < 0 {
		return b, nil
	}
	return b[:i], b[i+1:]
}

// pcAtou32 is the reference's atou: all ASCII digits or the value is 0; wraps modulo 2^32.
func pcAtou32(b []byte) uint32 {
	var n uint32
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0
		}
		n = n*10 + uint32(c-'0')
	}
	return n
}

// ---------------------------------------------------------------------------------------------
// Line framing

// pcLineFramer splits a byte stream into lines through one fixed buffer of maxLine bytes, so a
// connection's input memory is bounded. A line that does not fit is reported once as tooLong
// and its bytes are skipped up to the next "\n"; the lines after it are read normally.
type pcLineFramer struct {
	buf      []byte
	r, w     int  // buf[r:w] are unread bytes
	scan     int  // buf[r:scan] is known to hold no "\n"
	skipping bool // inside an overlong line
}

func newPCLineFramer(maxLine int) *pcLineFramer { return &pcLineFramer{buf: make([]byte, maxLine)} }

// space returns where to read more input, first moving a partial line to the buffer's start.
// It is never empty.
func (f *pcLineFramer) space() []byte {
	if f.r == f.w {
		f.r, f.w, f.scan = 0, 0, 0
	} else if f.w == len(f.buf) {
		n := copy(f.buf, f.buf[f.r:f.w])
		f.scan -= f.r
		f.r, f.w = 0, n
	}
	return f.buf[f.w:]
}

// wrote records n bytes read into space().
func (f *pcLineFramer) wrote(n int) { f.w += n }

// next returns the next complete line (without "\n", aliasing the buffer until the next
// space()), or tooLong once per overlong line, or ok=false when more input is needed.
func (f *pcLineFramer) next() (line []byte, tooLong, ok bool) {
	for {
		i := bytes.IndexByte(f.buf[f.scan:f.w], '\n')
		if i < 0 {
			break
		}
		end := f.scan + i
		line = f.buf[f.r:end]
		f.r, f.scan = end+1, end+1
		if f.skipping {
			f.skipping = false
			continue
		}
		return line, false, true
	}
	f.scan = f.w
	if f.skipping {
		f.r, f.w, f.scan = 0, 0, 0
		return nil, false, false
	}
	if f.r == 0 && f.w == len(f.buf) {
		f.skipping = true
		f.r, f.w, f.scan = 0, 0, 0
		return nil, true, true
	}
	return nil, false, false
}
