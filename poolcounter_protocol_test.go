// poolcounter_protocol_test.go: tests of the line decoder and the framer
// (poolcounter_protocol.go): corner cases of the reference's parser, and the fuzzer.

package main

import (
	"bytes"
	"fmt"
	"testing"
)

func (r pcRequest) String() string {
	return fmt.Sprintf("{op:%d key:%q workers:%d maxQueue:%d timeout:%d bad:%v item:%q}",
		r.op, r.key, r.workers, r.maxQueue, r.timeout, r.badSyntax, r.item)
}

// TestPoolCounterParse checks the decoder on the reference's corner cases.
func TestPoolCounterParse(t *testing.T) {
	for _, tc := range []struct {
		line string
		want pcRequest
	}{
		{"ACQ4ME k 1 2 3", pcRequest{op: pcOpAcqMe, key: []byte("k"), workers: 1, maxQueue: 2, timeout: 3}},
		{"ACQ4ANY k 1 2 3\r", pcRequest{op: pcOpAcqAny, key: []byte("k"), workers: 1, maxQueue: 2, timeout: 3}},
		{"ACQ4ME  k\t  4294967297 007", pcRequest{op: pcOpAcqMe, key: []byte("k\t"), workers: 1, maxQueue: 7}},
		{"ACQ4ME k 1 2 3\x00 4", pcRequest{op: pcOpAcqMe, key: []byte("k"), workers: 1, maxQueue: 2, timeout: 3}},
		{"ACQ4ME k 1 -2 3", pcRequest{op: pcOpAcqMe, key: []byte("k"), workers: 1, timeout: 3, badSyntax: true}},
		{"ACQ4ME ", pcRequest{op: pcOpAcqMe, badSyntax: true}},
		{"RELEASE whatever", pcRequest{op: pcOpRelease}},
		{"STATS FULL\r", pcRequest{op: pcOpStats, item: []byte("FULL")}},
		{"STATS FULL\r\r", pcRequest{op: pcOpStats, item: []byte("FULL\r")}},
		{"ACQ4ME\tk 1 1 1", pcRequest{}},
	} {
		got := parsePoolCounterLine([]byte(tc.line))
		if got.String() != tc.want.String() {
			t.Errorf("%q: got %s, want %s", tc.line, got, tc.want)
		}
	}
}

// FuzzPoolCounterLine fuzzes the line decoder and the framer: no input panics, decoded ACQs
// are well-formed and re-encode to the same request, and framing does not depend on how the
// stream is cut into reads.
func FuzzPoolCounterLine(f *testing.F) {
	for _, tr := range pcTranscripts() {
		for _, st := range tr.steps {
			if st.send != "" && len(st.send) < 2000 {
				f.Add([]byte(st.send), uint8(3))
			}
		}
	}
	f.Add([]byte("ACQ4ME k 1 2 3\nRELEASE\n\nSTATS FULL\r\n"), uint8(1))
	f.Add(bytes.Repeat([]byte("x"), 3000), uint8(200))
	f.Fuzz(func(t *testing.T, data []byte, cut uint8) {
		// Decoder.
		req := parsePoolCounterLine(data)
		if req.op == pcOpAcqMe || req.op == pcOpAcqAny {
			if !req.badSyntax {
				if len(req.key) == 0 || bytes.ContainsAny(req.key, " \x00") || req.workers == 0 || req.maxQueue == 0 {
					t.Fatalf("%q: accepted bad request %s", data, req)
				}
				verb := "ACQ4ME"
				if req.op == pcOpAcqAny {
					verb = "ACQ4ANY"
				}
				again := parsePoolCounterLine([]byte(fmt.Sprintf("%s %s %d %d %d", verb, req.key, req.workers, req.maxQueue, req.timeout)))
				if again.String() != req.String() {
					t.Fatalf("%q: %s re-encodes to %s", data, req, again)
				}
			}
		}
		// A server on this line never panics and its table stays consistent.
		s := newLockServer(nil)
		c := pcFakeConn(s, "fuzz")
		s.handleLine(c, data, false, nil)
		s.handleLine(c, data, false, nil)
		if err := s.checkInvariants(); err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		s.disconnect(c, s.clock())
		s.mu.Unlock()
		c.nc.Close()
		s.handlers.Wait()

		// Framer: feed data in chunks of size cut%17+1 through a small buffer and compare with
		// a model that splits the whole input at once.
		const maxLine = 16
		type ev struct {
			line    string
			tooLong bool
		}
		var want []ev
		rest := data
		for {
			i := bytes.IndexByte(rest, '\n')
			if i < 0 {
				if len(rest) >= maxLine {
					want = append(want, ev{tooLong: true})
				}
				break
			}
			if i >= maxLine {
				want = append(want, ev{tooLong: true})
			} else {
				want = append(want, ev{line: string(rest[:i])})
			}
			rest = rest[i+1:]
		}
		var got []ev
		fr := newPCLineFramer(maxLine)
		step := int(cut)%17 + 1
		for in := data; len(in) > 0; {
			sp := fr.space()
			if len(sp) == 0 {
				t.Fatal("framer has no space")
			}
			n := copy(sp, in[:min(step, len(in))])
			fr.wrote(n)
			in = in[n:]
			for {
				line, tooLong, ok := fr.next()
				if !ok {
					break
				}
				got = append(got, ev{string(line), tooLong})
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("%q cut %d: framer %+v, model %+v", data, step, got, want)
		}
	})
}
